"""Tensor and sequence parallelism (issue 17) against one rank, on real gloo processes.

Each rank builds the single-rank Linear from one seed and, beside it, its tensor-parallel shard
(the matching slice of the weight, `in_features` / `out_features` global as in TE), runs the same
inputs under the recipe, and compares:
- column-parallel: the output slice and the weight and bias gradient slices bitwise; the
  input gradient (all-reduced, or reduce-scattered under SP) within fp32 summation order;
- row-parallel: the input gradient slice and the weight gradient slice bitwise; the output
  (all-reduced, or reduce-scattered under SP) and, under SP, the bias gradient (summed over
  the ranks' rows) within fp32 summation order.
Shapes split on every format's block boundaries (128 for 2D blocks); per-tensor formats reduce
the split operands' amax over the TP group (tp_amax_reduction). Two steps, so delayed scaling
also checks that the TP ranks' histories (reduced over the group) give the single-rank scales.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

import minifloat as mf

from .launch import run_ranks

RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "delayed": lambda: mf.DelayedScaling(amax_history_len=2),
    "block": lambda: mf.Float8BlockScaling(),
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
    "hybrid": lambda: mf.HybridRecipe(
        fprop=mf.MXFP8BlockScaling(),
        dgrad=mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
        wgrad=mf.NVFP4BlockScaling(disable_stochastic_rounding=True)),
}
TOKENS, FEATURES = 256, 256


def _run(module, x, dy, recipe, group):
    x = x.clone().requires_grad_(True)
    with mf.autocast(recipe=recipe, amax_reduction_group=group):
        y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def worker(rank: int, world: int, name: str, mode: str, sequence_parallel: bool,
           features: int) -> dict:
    group = dist.group.WORLD
    torch.manual_seed(0)
    single = mf.Linear(features, features, name="fc")
    tp = mf.Linear(features, features, name="fc", tp_group=group, parallel_mode=mode,
                   sequence_parallel=sequence_parallel)
    part = features // world
    mine = slice(rank * part, (rank + 1) * part)
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    with torch.no_grad():
        if mode == "column":
            tp.weight.copy_(single.weight[mine])
            tp.bias.copy_(single.bias[mine])
        else:
            tp.weight.copy_(single.weight[:, mine])
            tp.bias.copy_(single.bias)
    generator = torch.Generator().manual_seed(1)
    results = []
    for _ in range(2):
        x = torch.randn(TOKENS, features, generator=generator) * 3
        dy = torch.randn(TOKENS, features, generator=generator)
        want = _run(single, x, dy, RECIPES[name](), None)
        if mode == "column":
            tp_x = x[rows] if sequence_parallel else x
            tp_dy = dy[:, mine]
        else:
            tp_x = x[:, mine]
            tp_dy = dy[rows] if sequence_parallel else dy
        got = _run(tp, tp_x, tp_dy, RECIPES[name](), group)
        results.append({"want": want, "got": got})
        single.zero_grad(set_to_none=True)
        tp.zero_grad(set_to_none=True)
    return {"steps": results, "mine": (mine.start, mine.stop), "rows": (rows.start, rows.stop),
            "pickled": pickle.dumps(tp)}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within fp32 summation order (a sum over ranks against one GEMM's accumulation)."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def check(results: list, mode: str, sequence_parallel: bool, label: str) -> None:
    for rank, result in enumerate(results):
        mine = slice(*result["mine"])
        rows = slice(*result["rows"])
        for step, pair in enumerate(result["steps"]):
            (y, dx, dw, db), (ty, tdx, tdw, tdb) = pair["want"], pair["got"]
            where = f"{label} rank {rank} step {step}"
            if mode == "column":
                assert torch.equal(ty, y[:, mine]), f"{where}: output"
                assert torch.equal(tdw, dw[mine]), f"{where}: weight gradient"
                assert torch.equal(tdb, db[mine]), f"{where}: bias gradient"
                assert close(tdx, dx[rows] if sequence_parallel else dx), f"{where}: dx"
            else:
                assert torch.equal(tdx, dx[:, mine]), f"{where}: input gradient"
                assert torch.equal(tdw, dw[:, mine]), f"{where}: weight gradient"
                # under SP each rank's rows give a partial bias gradient, summed over the group
                assert (close(tdb, db) if sequence_parallel else torch.equal(tdb, db)), \
                    f"{where}: bias gradient"
                assert close(ty, y[rows] if sequence_parallel else y), f"{where}: output"


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("mode", ["column", "row"])
def test_two_ranks_equal_one_rank(name, mode):
    for sequence_parallel in (False, True):
        results = run_ranks(worker, 2, name, mode, sequence_parallel, FEATURES, timeout=180)
        check(results, mode, sequence_parallel, f"{name} {mode} sp={sequence_parallel}")


@pytest.mark.parametrize("mode", ["column", "row"])
def test_four_ranks_equal_one_rank(mode):
    results = run_ranks(worker, 4, "current", mode, True, 512, timeout=180)
    check(results, mode, True, f"current {mode} 4 ranks")
