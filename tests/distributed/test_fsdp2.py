"""FSDP2 (torch.distributed.fsdp.fully_shard) on minifloat models, high-precision sharded
parameters (issue 16, mode (a)): FSDP2 gathers the weights, minifloat quantizes after the gather.

Two real processes over gloo train a few steps, each on its half of the global batch; one
process then trains the same model on the same halves as two micro-batches, summing their
gradients and halving them (what FSDP2's reduce-scatter computes for two ranks, exactly: a sum
of two numbers is the same in either order and halving is exact). The quantized bytes are the
same in both runs:
- activations and gradients are quantized per rank (per micro-batch) in both;
- weights are quantized from the gathered full weight in both;
- delayed scaling: both ranks use the same scales and all-reduce their amaxes over
  `autocast(amax_reduction_group=...)`; the reference runs both micro-batches in one autocast,
  so its history records the max of both.
So the parameters after training must be equal bit for bit, and so must each rank's losses.
The same holds when the FSDP2 run rebuilds its weight copies in backward (from the weight FSDP2
re-gathers, freed between forward and backward) instead of keeping them.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minifloat as mf
from minifloat.distributed import rebuild_weight_copies_in_backward
from minifloat.modules.extra_state import decode
from recipe_factories import FORMAT_RECIPES

from .launch import cpu_randn, device_mesh, run_ranks

WORLD = 2
STEPS = 3
HIDDEN, FFN, ROWS = 128, 256, 64  # block FP8 needs multiples of 128 in the weights

# the FSDP2 run keeps no weight copy from forward to backward, and the inputs in high precision
# instead of their copies (rebuild_weight_copies_in_backward, save_original_inputs)
REBUILD = "+rebuild"
RECIPES = FORMAT_RECIPES


class PlainBlock(nn.Module):
    """What a user brings (converted by convert_model)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "modules":
        return nn.Sequential(mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", name="mlp"),
                             mf.Linear(HIDDEN, HIDDEN, name="proj"))
    return mf.convert_model(nn.Sequential(PlainBlock(), PlainBlock()))


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [cpu_randn(WORLD * ROWS, HIDDEN, generator=generator) for _ in range(STEPS)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_sharded(model: nn.Module, recipe, rank: int, world_size: int) -> list[torch.Tensor]:
    """SGD steps of the sharded model on this rank's part of each batch; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches():
        with mf.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = loss_of(model, x.chunk(world_size)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    mf.update_delayed_backward_scales()
    return losses


def fsdp_worker(rank: int, world_size: int, kind: str) -> dict:
    """Every recipe in turn on this rank's half of each batch; full parameters at the end."""
    mesh = device_mesh((world_size,))
    results = {}
    for name, make_recipe in RECIPES.items():
        recipe = make_recipe()
        model = build(kind.removesuffix(REBUILD))
        if kind.endswith(REBUILD):  # backward reads the re-gathered weight, keeps no copy
            rebuild_weight_copies_in_backward(mf.save_original_inputs(model))
        model = shard(model, mesh)
        losses = train_sharded(model, recipe, rank, world_size)
        state = model.state_dict()
        params = {key: value.full_tensor() for key, value in state.items()
                  if isinstance(value, torch.Tensor)}
        extra = {key: value for key, value in state.items() if key.endswith("_extra_state")}
        quantizers = [module.quantizers(recipe) for module in model.modules()
                      if isinstance(module, mf.Linear | mf.LayerNormMLP)]
        results[name] = {"losses": losses, "params": params, "extra": extra,
                         "pickled_quantizers": pickle.dumps(quantizers)}
    return results


def reference(kind: str, name: str) -> dict:
    recipe = RECIPES[name]()
    model = build(kind.removesuffix(REBUILD))  # keeps its weight copies: the default
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [[] for _ in range(WORLD)]
    for x in batches():
        with mf.autocast(recipe=recipe):
            for rank, piece in enumerate(x.chunk(WORLD)):
                loss = loss_of(model, piece)
                loss.backward()
                losses[rank].append(loss.detach())
        for parameter in model.parameters():
            parameter.grad /= WORLD
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mf.update_delayed_backward_scales()
    state = model.state_dict()
    return {"losses": losses,
            "params": {k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
            "extra": {k: v for k, v in state.items() if k.endswith("_extra_state")}}


@pytest.fixture(scope="module", params=["modules", "convert_model", "convert_model" + REBUILD])
def fsdp_results(request):
    return request.param, run_ranks(fsdp_worker, WORLD, request.param, timeout=240)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fsdp2_training_equals_one_process_bitwise(fsdp_results, name):
    kind, per_rank = fsdp_results
    want = reference(kind, name)
    for rank, results in enumerate(per_rank):
        got = results[name]
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"][rank], strict=True)):
            assert torch.equal(a, b), f"{kind} {name} rank {rank} step {step} loss"
        assert got["params"].keys() == want["params"].keys()
        for key, value in want["params"].items():
            assert torch.equal(got["params"][key], value), f"{kind} {name} rank {rank} {key}"
        # the recipe state each module saves (delayed scaling: the reduced amax histories and
        # the scales) is the single process's too
        assert got["extra"].keys() == want["extra"].keys() and want["extra"]
        for key, value in want["extra"].items():
            mine, value = decode(got["extra"][key]), decode(value)
            assert [e["recipe"] for e in mine["recipes"]] == [e["recipe"] for e in value["recipes"]]
            for a, b in zip(mine["recipes"], value["recipes"], strict=True):
                for x, y in zip(a["forward"] + a["backward"], b["forward"] + b["backward"],
                                strict=True):
                    assert torch.equal(x, y), f"{kind} {name} rank {rank} {key}"


def test_quantizers_pickle_after_distributed_steps(fsdp_results):
    """No process group stays on a quantizer: pickling them inside the ranks succeeded after
    steps with an amax reduction group, and they load without one."""
    _, per_rank = fsdp_results
    for results in per_rank:
        for name in RECIPES:
            for pair in pickle.loads(results[name]["pickled_quantizers"]):
                for quantizer in [*pair[0], *pair[1]]:
                    assert getattr(quantizer, "amax_reduction_group", None) is None


def quantized_init_worker(rank: int, world_size: int) -> list[str]:
    """fully_shard on quantized_model_init weights: FSDP2 splits them with tensor ops, which a
    QuantizedTensor answers in high precision. Not supported yet; it must not pass unnoticed."""
    import warnings

    recipe = mf.Float8CurrentScaling()
    with mf.quantized_model_init(recipe=recipe):
        model = nn.Sequential(mf.Linear(HIDDEN, HIDDEN, name="q"))
    shard(model, device_mesh((world_size,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # said once
            with mf.autocast(recipe=recipe):
                model(torch.randn(ROWS, HIDDEN)).sum().backward()
    return [str(w.message) for w in caught if "quantized_model_init" in str(w.message)]


def test_fsdp2_on_quantized_model_init_weights_is_reported():
    for messages in run_ranks(quantized_init_worker, WORLD, timeout=120):
        assert len(messages) == 1 and "fully_shard" in messages[0]


def test_quantized_model_init_alone_reports_nothing():
    import warnings

    recipe = mf.Float8CurrentScaling()
    with mf.quantized_model_init(recipe=recipe):
        layer = mf.Linear(HIDDEN, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mf.autocast(recipe=recipe):
            layer(torch.randn(ROWS, HIDDEN)).sum().backward()
