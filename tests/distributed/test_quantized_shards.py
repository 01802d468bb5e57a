"""quantized_model_init weights under FSDP2 (distributed/quantized_shards.py): the FP8 bytes are
sharded and all-gathered as they are, and quantize_master_weights casts each rank's fp32 master
rows into its own shard, with the amax all-reduced over the group.

Two gloo ranks train against one process that runs the same two halves of each batch as
micro-batches (summing their gradients and halving them, what FSDP2's reduce-scatter computes for
two ranks, exactly) and casts its full masters. Activations and gradients are quantized per rank
in both, the gathered weight is the full weight's bytes in both, and each master row gets the
same update: losses, masters, FP8 bytes and scales must be equal bit for bit.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minifloat as mf
from minifloat.distributed import (
    enable_low_precision_all_gather,
    post_all_gather_processing,
    quantize_master_weights,
)

from .launch import cpu_randn, device_mesh, run_ranks

WORLD, ROWS, STEPS = 2, 32, 3
NVFP4 = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)
CASES = {  # recipe, width (each rank holds width / 2 rows of each weight)
    "current": (mf.Float8CurrentScaling, 64),
    "delayed": (lambda: mf.DelayedScaling(amax_history_len=1), 64),
    "block": (mf.Float8BlockScaling, 192),  # 96 rows a rank: a 128x128 tile on both ranks
    "mxfp8": (mf.MXFP8BlockScaling, 96),  # 48 rows a rank: a 32-row columnwise block on both
    "nvfp4": (lambda: NVFP4, 64),
    "nvfp4-cut-tiles": (lambda: NVFP4, 48),  # 24 rows a rank: a 16x16 tile on both ranks
    # hybrid weights (seed 000): a format per direction, each part sharded and gathered as it
    # is (hybrid_shards.py); MXFP8 forward, NVFP4 backward; current forward, blocks backward
    # with 96 rows a rank (a 128x128 tile on both ranks)
    "hybrid-mxfp8-nvfp4": (lambda: mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=NVFP4,
                                                   wgrad=NVFP4), 64),
    "hybrid-current-block": (lambda: mf.HybridRecipe(
        fprop=mf.Float8CurrentScaling(), dgrad=mf.Float8BlockScaling(),
        wgrad=mf.Float8CurrentScaling()), 192),
}
# the rowwise buffers a shard holds (row slices of the full weight's) and the shared ones
ROW_FIELDS = {"fp8": ("data",), "block": ("rowwise_data",),
              "mxfp8": ("rowwise_data", "rowwise_scale", "columnwise_data"),
              "nvfp4": ("rowwise_data", "rowwise_scale")}
SHARED_FIELDS = {"fp8": ("scale_inv",), "block": ("rowwise_scale_inv",),
                 "mxfp8": ("columnwise_scale",), "nvfp4": ("amax_rowwise",)}


def build(name: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """Two quantized-weight Linears and the fp32 masters of their weights (initial values)."""
    make_recipe, hidden = CASES[name]
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=make_recipe(), keep_high_precision_copy=True):
        model = nn.Sequential(mf.Linear(hidden, hidden, bias=False, name="a"),
                              mf.Linear(hidden, hidden, bias=False, name="b"))
    with torch.no_grad():  # the largest values in rows the second rank holds
        model[0].weight_hp_init[hidden // 2:hidden // 2 + 4] *= 20
    masters = [layer.weight_hp_init.float() for layer in model]
    # the weights start as the masters' cast (the masters were just changed)
    quantize_master_weights([layer.weight for layer in model], [m.reshape(-1) for m in masters],
                            [0, 0])
    post_all_gather_processing([layer.weight for layer in model])
    return model, masters


def batches(name: str) -> list[torch.Tensor]:
    hidden = CASES[name][1]
    generator = torch.Generator().manual_seed(1)
    return [cpu_randn(WORLD * ROWS, hidden, generator=generator) for _ in range(STEPS)]


# a hybrid weight's sub-storages and their (row fields, shared fields): the dgrad part keeps the
# rowwise copy its columnwise one derives from
HYBRID_FIELDS = {
    "hybrid-mxfp8-nvfp4": {"rowwise_storage": (("rowwise_data", "rowwise_scale"), ()),
                           "columnwise_storage": (("rowwise_data", "rowwise_scale"),
                                                  ("amax_rowwise",))},
    "hybrid-current-block": {"rowwise_storage": (("data",), ("scale_inv",)),
                             "columnwise_storage": (("rowwise_data",), ("rowwise_scale_inv",))},
}


def kind_of(name: str) -> str:
    if name.startswith("hybrid"):
        return name
    return name.split("-")[0] if name.startswith(("nvfp4", "block", "mxfp8")) else "fp8"


for _name, _subs in HYBRID_FIELDS.items():  # flattened as "<sub-storage>.<field>"
    ROW_FIELDS[_name] = tuple(f"{sub}.{f}" for sub, (rows, _) in _subs.items() for f in rows)
    SHARED_FIELDS[_name] = tuple(f"{sub}.{f}" for sub, (_, shared) in _subs.items()
                                 for f in shared)


def _field(storage, path: str) -> torch.Tensor:
    for attribute in path.split("."):
        storage = getattr(storage, attribute)
    return storage


def fields(storage, name: str) -> dict[str, torch.Tensor]:
    kind = kind_of(name)
    return {field: _field(storage, field).clone()
            for field in ROW_FIELDS[kind] + SHARED_FIELDS[kind]}


def sharded_worker(rank: int, world_size: int, name: str, compiled: bool = False,
                   kept: bool = False) -> dict:
    """kept: the layers keep their gathered weights for backward (reshard_after_forward=False),
    so MXFP8 and hybrid weights gather both directions in forward (kept_gathered.py)."""
    from torch.distributed.fsdp import fully_shard

    recipe = CASES[name][0]()
    hidden = CASES[name][1]
    model, full_masters = build(name)
    enable_low_precision_all_gather(model, recipe)
    mesh = device_mesh((world_size,))
    for layer in model:
        if compiled:  # each layer compiled, then sharded (the gathered weight is traced)
            layer.compile(backend="aot_eager", fullgraph=True)
        fully_shard(layer, mesh=mesh, reshard_after_forward=not kept)
    fully_shard(model, mesh=mesh)
    rows = hidden // world_size
    masters = [m[rank * rows:(rank + 1) * rows].reshape(-1).clone() for m in full_masters]
    starts = [rank * rows * hidden] * len(masters)
    params = [layer.weight for layer in model]
    optimizer = torch.optim.SGD(masters, lr=0.5)
    losses = []
    for x in batches(name):
        with mf.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = model(x.chunk(world_size)[rank]).float().pow(2).mean()
        loss.backward()
        for master, param in zip(masters, params, strict=True):
            master.grad = param.grad.to_local().float().reshape(-1)
            param.grad = None
        optimizer.step()
        quantize_master_weights(params, masters, starts, group=dist.group.WORLD)
        losses.append(loss.detach().clone())
    mf.update_delayed_backward_scales()
    return {"losses": losses, "masters": masters,
            "storages": [fields(param.to_local().shard_storage(), name) for param in params],
            "pickled": pickle.dumps([param.to_local() for param in params])}


def reference(name: str) -> dict:
    recipe = CASES[name][0]()
    model, masters = build(name)
    masters = [m.reshape(-1).clone() for m in masters]
    optimizer = torch.optim.SGD(masters, lr=0.5)
    losses = [[] for _ in range(WORLD)]
    for x in batches(name):
        with mf.autocast(recipe=recipe):
            for rank, piece in enumerate(x.chunk(WORLD)):
                loss = model(piece).float().pow(2).mean()
                loss.backward()
                losses[rank].append(loss.detach())
        for master, layer in zip(masters, model, strict=True):
            master.grad = (layer.weight.grad / WORLD).float().reshape(-1)
            layer.weight.grad = None
        optimizer.step()
        weights = [layer.weight for layer in model]
        quantize_master_weights(weights, masters, [0, 0])
        post_all_gather_processing(weights)  # the transposed copies dgrad reads
    mf.update_delayed_backward_scales()
    return {"losses": losses, "masters": masters,
            "storages": [fields(layer.weight.quantized_storage, name) for layer in model]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_quantized_weights_train_like_one_process_bitwise(name):
    assert_trained_like_one_process(name, run_ranks(sharded_worker, WORLD, name, timeout=120))


@pytest.mark.parametrize("name", ["mxfp8", "hybrid-mxfp8-nvfp4", "hybrid-current-block"])
def test_weights_kept_gathered_after_forward_train_like_one_process_bitwise(name):
    """One direction a gather, unless FSDP2 keeps the weight gathered for backward."""
    assert_trained_like_one_process(
        name, run_ranks(sharded_worker, WORLD, name, False, True, timeout=120))


def assert_trained_like_one_process(name: str, results: list[dict]) -> None:
    want = reference(name)
    hidden = CASES[name][1]
    rows = hidden // WORLD
    kind = kind_of(name)
    for rank, got in enumerate(results):
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"][rank], strict=True)):
            assert torch.equal(a, b), f"{name} rank {rank} step {step} loss"
        for index in range(2):
            mine = slice(rank * rows * hidden, (rank + 1) * rows * hidden)
            assert torch.equal(got["masters"][index], want["masters"][index][mine])
            shard, full = got["storages"][index], want["storages"][index]
            for field in ROW_FIELDS[kind]:
                assert torch.equal(_bits(shard[field]),
                                   _bits(full[field][rank * rows:(rank + 1) * rows])), field
            for field in SHARED_FIELDS[kind]:
                assert torch.equal(shard[field], full[field]), field
        # the shards pickle after steps with a reduction group, and hold no group (seed 003)
        for shard, storage in zip(pickle.loads(got["pickled"]), got["storages"], strict=True):
            quantizer = shard.shard_storage().quantizer
            assert getattr(quantizer, "amax_reduction_group", None) is None
            first = ROW_FIELDS[kind][0]
            unpickled = _field(shard.shard_storage(), first)  # on the rank's device (NCCL)
            assert torch.equal(_bits(unpickled.to(storage[first].device)), _bits(storage[first]))


COMPILED_CASES = ["current", "delayed", "block", "nvfp4-cut-tiles"]


def compiled_worker(rank: int, world_size: int) -> dict:
    import torch._dynamo

    results = {}
    for name in COMPILED_CASES:
        torch._dynamo.reset()
        results[name] = {compiled: sharded_worker(rank, world_size, name, compiled)
                         for compiled in (False, True)}
    for compiled in (False, True):  # kept gathered, MXFP8 shards bring both copies: compiled
        torch._dynamo.reset()
        results.setdefault("mxfp8-kept", {})[compiled] = sharded_worker(
            rank, world_size, "mxfp8", compiled, kept=True)
    torch._dynamo.reset()
    try:  # MXFP8 shards gather a direction per gather: refused, on every rank alike
        sharded_worker(rank, world_size, "mxfp8", compiled=True)
        results["mxfp8"] = "no error"
    except Exception as error:  # noqa: BLE001 - dynamo wraps the library's error
        results["mxfp8"] = str(error)
    return results


def test_compiled_layers_train_sharded_quantized_weights_like_eager_bitwise():
    """The same training as above with each layer compiled (fullgraph, aot_eager): the
    gathered quantized weights reach the graph as their bytes (quantized_weight_ops.py). The
    bytes do not change between forward and backward (the master cast runs after the step),
    so delayed scaling compiles too. Losses, masters and every rank's shard bytes equal the
    eager run's. MXFP8 shards, which gather their rowwise copy for forward and their columnwise
    copy for backward, refuse to compile with a clear error, unless FSDP2 keeps them gathered
    for backward (both copies gathered in forward)."""
    results = run_ranks(compiled_worker, WORLD, timeout=240)
    for rank, result in enumerate(results):
        for name in [*COMPILED_CASES, "mxfp8-kept"]:
            eager, compiled = result[name][False], result[name][True]
            for a, b in zip(compiled["losses"], eager["losses"], strict=True):
                assert torch.equal(a, b), (rank, name)
            for a, b in zip(compiled["masters"], eager["masters"], strict=True):
                assert torch.equal(a, b), (rank, name)
            for mine, theirs in zip(compiled["storages"], eager["storages"], strict=True):
                for field, value in theirs.items():
                    assert torch.equal(_bits(mine[field]), _bits(value)), (rank, name, field)
        assert "gather MXFP8 weights in high precision" in result["mxfp8"]


def nvfp4_1d(role):
    return mf.NVFP4Quantizer(with_2d_quantization=False)


def test_other_quantized_formats_are_refused_clearly():
    recipe = mf.CustomRecipe(nvfp4_1d)  # 1D NVFP4 weights: not a weight format
    with mf.quantized_model_init(recipe=recipe):
        model = nn.Sequential(mf.Linear(64, 64, name="nv1d"))
    with pytest.raises(NotImplementedError, match="2D NVFP4 with a rowwise copy"):
        enable_low_precision_all_gather(model, recipe)


def test_the_bytes_refuse_arithmetic():
    """An optimizer step on the sharded bytes would be meaningless: it must go through the
    masters, and says so."""
    from minifloat.distributed.quantized_shards import QuantizedShardWeight

    with mf.quantized_model_init(recipe=mf.Float8CurrentScaling()):
        layer = mf.Linear(64, 64)
    shard = QuantizedShardWeight.of(layer.weight)
    with pytest.raises(NotImplementedError, match="quantize_master_weights"):
        shard.add_(1.0)
    assert torch.equal(shard.narrow(0, 0, 8)._data, shard._data[:8])
    # FSDP2's mixed precision casts parameters to param_dtype before the all-gather: that names
    # the dtype the gathered weight computes in, and keeps the bytes
    relabeled = shard.to(torch.bfloat16)
    assert relabeled.dtype == torch.bfloat16 and relabeled._data is shard._data
