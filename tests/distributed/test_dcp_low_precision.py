"""torch.distributed.checkpoint of FSDP2 models whose weights are gathered in low precision
(issue 20, item 3; distributed/shard_state_dict.py), over gloo:

- enable_low_precision_all_gather on high-precision weights: the checkpoint holds the
  high-precision values (no quantizer pickled: DCP reads it with weights_only) and loads into
  one process's plain model;
- quantized_model_init weights sharded as bytes: saved as their bytes and scales, resharded
  2 -> 4 and 2 -> 1 (a one-rank FSDP2 group) with every byte and scale equal, and the loaded
  model's next forward equal to the saved one's;
- high_precision_state_dict exports those shards dequantized, loadable into a plain model.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.distributed import enable_low_precision_all_gather, high_precision_state_dict

from . import test_fsdp2 as fsdp2_case
from . import test_quantized_shards as shards_case
from .launch import cpu_randn, device_mesh, run_ranks

SHARD_CASES = ["current", "block", "mxfp8", "nvfp4-cut-tiles", "hybrid-mxfp8-nvfp4"]


def probe(name: str) -> torch.Tensor:
    """One input every rank feeds whole (so outputs compare across world sizes)."""
    return cpu_randn(32, shards_case.CASES[name][1], generator=torch.Generator().manual_seed(5))


def sharded_quantized_model(name: str, world_size: int, seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model, _ = shards_case.build(name)
    if seed:  # other weights than the saved model's: everything must come from the checkpoint
        for layer in model:
            for rows in layer.weight.quantized_storage.tensor_fields():
                buffer = getattr(layer.weight.quantized_storage, rows)
                if buffer is not None:
                    buffer.view(torch.uint8).zero_()
    enable_low_precision_all_gather(model, shards_case.CASES[name][0]())
    mesh = device_mesh((world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shard_fields(model, name: str) -> list[dict[str, torch.Tensor]]:
    return [{field: value.view(torch.uint8) if value.element_size() == 1 else value
             for field, value in shards_case.fields(p.to_local().shard_storage(), name).items()}
            for p in model.parameters()]


def forward(model, name: str) -> torch.Tensor:
    with torch.no_grad(), mf.autocast(recipe=shards_case.CASES[name][0]()):
        return model(probe(name))


def save_shards_worker(rank: int, world_size: int, folder: str, name: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = sharded_quantized_model(name, world_size, seed=0)
    state = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=folder)
    exported = {k: v.full_tensor() for k, v in high_precision_state_dict(model).items()}
    return {"fields": shard_fields(model, name), "output": forward(model, name),
            "exported": exported}


def load_shards_worker(rank: int, world_size: int, folder: str, name: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = sharded_quantized_model(name, world_size, seed=rank + 3)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)
    return {"fields": shard_fields(model, name), "output": forward(model, name)}


def _whole(results: list[dict], weight: int, field: str, shared: bool) -> torch.Tensor:
    """A field of the full weight: the ranks' rows in order, or the shared value (checked
    equal on every rank)."""
    values = [result["fields"][weight][field] for result in results]
    if shared:
        assert all(torch.equal(v, values[0]) for v in values), field
        return values[0]
    return torch.cat(values)


@pytest.mark.parametrize("name", SHARD_CASES)
def test_quantized_shards_are_saved_as_bytes_and_reshard(name, tmp_path):
    folder = str(tmp_path / "checkpoint")
    saved = run_ranks(save_shards_worker, 2, folder, name, timeout=120)
    kind = shards_case.kind_of(name)
    for world_size in (4, 1):
        loaded = run_ranks(load_shards_worker, world_size, folder, name, timeout=120)
        for weight in range(2):
            for field in shards_case.ROW_FIELDS[kind] + shards_case.SHARED_FIELDS[kind]:
                shared = field in shards_case.SHARED_FIELDS[kind]
                assert torch.equal(_whole(loaded, weight, field, shared),
                                   _whole(saved, weight, field, shared)), (world_size, field)
        for result in loaded:
            assert torch.equal(result["output"], saved[0]["output"]), world_size


@pytest.mark.parametrize("name", ["current", "nvfp4-cut-tiles"])
def test_high_precision_export_of_quantized_shards(name, tmp_path):
    """The export is the dequantized full weight and loads into a model built without
    quantized_model_init, whose plain forward then equals the quantized model's."""
    saved = run_ranks(save_shards_worker, 2, str(tmp_path / "unused"), name, timeout=120)
    model, _ = shards_case.build(name)  # the same weights, unsharded
    exported = saved[0]["exported"]
    assert set(exported) == {"0.weight", "1.weight"}  # no recipe state by default
    for index, layer in enumerate(model):
        assert torch.equal(exported[f"{index}.weight"], layer.weight.dequantize())
    hidden = shards_case.CASES[name][1]
    plain = torch.nn.Sequential(mf.Linear(hidden, hidden, bias=False, name="a"),
                                mf.Linear(hidden, hidden, bias=False, name="b"))
    with pytest.warns(UserWarning, match="start afresh"):  # the export drops recipe state
        plain.load_state_dict(exported, strict=False)
    assert not isinstance(plain[0].weight, mf.QuantizedTensor)
    x = probe(name)
    assert torch.equal(plain(x), model(x))  # outside autocast: the dequantized weights


def save_low_precision_gather_worker(rank: int, world_size: int, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    recipe = mf.Float8CurrentScaling()
    model = fsdp2_case.build("modules")
    enable_low_precision_all_gather(model, recipe)
    model = fsdp2_case.shard(model, device_mesh((world_size,)))
    fsdp2_case.train_sharded(model, recipe, rank, world_size)
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)
    return {k: v.full_tensor() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)}


def test_low_precision_gather_model_saves_its_high_precision_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = str(tmp_path / "checkpoint")
    saved = run_ranks(save_low_precision_gather_worker, 2, folder, timeout=120)[0]
    torch.manual_seed(11)
    plain = fsdp2_case.build("modules")  # no wrapper, no FSDP2
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=folder)  # DCP reads with weights_only: no quantizer inside
    plain.load_state_dict(state)
    for key, value in saved.items():
        assert torch.equal(plain.state_dict()[key], value), key
