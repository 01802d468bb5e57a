"""DDP around minifloat models, and torch's DTensor tensor parallelism refused clearly
(issue 17), on real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minifloat as mf

from .launch import cpu_randn, device_mesh, run_ranks

HIDDEN, TOKENS = 64, 32


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(mf.LayerNormMLP(HIDDEN, 2 * HIDDEN, normalization="RMSNorm"),
                         mf.Linear(HIDDEN, HIDDEN))


def batches(world: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [cpu_randn(world * TOKENS, HIDDEN, generator=generator) for _ in range(3)]


def scales(model: nn.Module, recipe) -> list[torch.Tensor]:
    return [state.scale.clone() for module in model.modules()
            if hasattr(module, "recipe_states")
            for state in module.recipe_states(recipe)]


def train(model: nn.Module, recipe, xs, group, world: int = 1
          ) -> tuple[list[float], list[list]]:
    """Losses, and the forward states' scales after each step (forward's autocast exit
    updates them from the step's amaxes). Each rank's loss is its share of the global mean
    (the same output gradients as one process), and the learning rate is scaled by the world
    size (DDP averages the ranks' gradients): the math of one process on the global batch."""
    inner = model.module if hasattr(model, "module") else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * world)
    losses, step_scales = [], []
    for x in xs:
        with mf.autocast(recipe=recipe, amax_reduction_group=group):
            y = model(x).float()
            loss = y.pow(2).sum() / (y.numel() * world)
        step_scales.append(scales(inner, recipe)[0::2])  # forward states
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, step_scales


def ddp_worker(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    recipe = mf.DelayedScaling(amax_history_len=4)
    model = DistributedDataParallel(build())
    xs = [x.chunk(world)[rank] for x in batches(world)]
    losses, step_scales = train(model, recipe, xs, dist.group.WORLD, world)
    return {"losses": losses, "step_scales": step_scales,
            "weights": [p.detach().clone() for p in model.module.parameters()]}


def test_ddp_with_delayed_scaling_reduces_amaxes_over_the_data_parallel_group():
    """Each rank trains its half of the global batch under DDP; autocast's
    amax_reduction_group reduces the delayed-scaling histories over the DP group, so every
    rank's forward scales after the first step are the single process's on the whole batch,
    bitwise (later steps within 1e-4: DDP sums the gradients in another order, so the weights
    drift in fp32), and equal across ranks at every step."""
    recipe = mf.DelayedScaling(amax_history_len=4)
    single = build()
    _, single_scales = train(single, recipe, batches(2), None)
    results = run_ranks(ddp_worker, 2, timeout=180)
    for rank, result in enumerate(results):
        for step, (mine, want) in enumerate(zip(result["step_scales"], single_scales,
                                                strict=True)):
            for a, b in zip(mine, want, strict=True):
                if step == 0:
                    assert torch.equal(a, b), f"rank {rank}: forward scales"
                assert torch.allclose(a, b, rtol=1e-4), f"rank {rank} step {step}"
    for a, b in zip(results[0]["step_scales"], results[1]["step_scales"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(result["weights"], single.parameters(), strict=True):
            assert torch.allclose(a, b.detach(), rtol=1e-4, atol=1e-5), f"rank {rank}"
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        assert torch.equal(a, b)  # DDP keeps the replicas identical


def dtensor_worker(rank: int, world: int) -> str:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = device_mesh((world,))
    # torch's styles take only nn.Linear: a user shards a plain model, then converts it
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    try:
        model = mf.convert_model(model, mf.Float8CurrentScaling())
        with mf.autocast(recipe=mf.Float8CurrentScaling()):
            model(torch.randn(TOKENS, HIDDEN))
    except TypeError as error:
        return str(error)
    return ""


def test_dtensor_tensor_parallelism_is_refused_with_the_module_arguments():
    for message in run_ranks(dtensor_worker, 2, timeout=120):
        assert "parallel_mode" in message and "DTensor" in message


def test_outside_distributed_the_check_costs_nothing_visible():
    """A plain module under autocast still runs (the DTensor test is a type check)."""
    with mf.autocast(recipe=mf.Float8CurrentScaling()):
        y = mf.Linear(HIDDEN, HIDDEN)(torch.randn(TOKENS, HIDDEN))
    assert y.shape == (TOKENS, HIDDEN)
    with pytest.raises(ValueError):
        mf.Linear(HIDDEN, HIDDEN, parallel_mode="column", tp_size=3)
