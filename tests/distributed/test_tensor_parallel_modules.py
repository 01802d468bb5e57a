"""LayerNormLinear (column-parallel) and LayerNormMLP (fc1 column, fc2 row) under tensor and
sequence parallelism, against one rank, on real gloo processes (see test_tensor_parallel.py).

Bitwise: LayerNormLinear's output and weight-gradient slices; LayerNormMLP's weight-gradient
slices (fc1's of each half of a gated fc1). Within fp32 summation order: what sums over the
ranks (LayerNormMLP's output, the input gradient, the norm parameters' gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import minifloat as mf

from .launch import cpu_randn, run_ranks
from .test_tensor_parallel import RECIPES, close

TOKENS, HIDDEN, FFN = 128, 256, 256


def _slices(tensor: torch.Tensor, mine: slice, halves: int) -> torch.Tensor:
    """Rows `mine` of each of `halves` equal parts of dim 0 (a gated fc1 stacks two)."""
    return torch.cat([part[mine] for part in tensor.chunk(halves)])


def mlp_worker(rank: int, world: int, name: str, activation: str) -> dict:
    group = dist.group.WORLD
    halves = 2 if activation in ("swiglu", "geglu") else 1
    mine = slice(rank * FFN // world, (rank + 1) * FFN // world)
    results = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        single = mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", activation=activation)
        tp = mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", activation=activation,
                             tp_group=group, set_parallel_mode=True,
                             sequence_parallel=sequence_parallel)
        with torch.no_grad():
            tp.layer_norm_weight.copy_(single.layer_norm_weight.detach() * 1.5)
            single.layer_norm_weight.mul_(1.5)
            tp.fc1_weight.copy_(_slices(single.fc1_weight, mine, halves))
            tp.fc1_bias.copy_(_slices(single.fc1_bias, mine, halves))
            tp.fc2_weight.copy_(single.fc2_weight[:, mine])
            tp.fc2_bias.copy_(single.fc2_bias)
        generator = torch.Generator().manual_seed(1)
        x = cpu_randn(TOKENS, HIDDEN, generator=generator) * 3
        dy = cpu_randn(TOKENS, HIDDEN, generator=generator)
        rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
        outs = []
        for module, xs, dys, grp in ((single, x, dy, None),
                                     (tp, x[rows] if sequence_parallel else x,
                                      dy[rows] if sequence_parallel else dy, group)):
            xs = xs.clone().requires_grad_(True)
            with mf.autocast(recipe=RECIPES[name](), amax_reduction_group=grp):
                y = module(xs)
            y.backward(dys)
            outs.append({"y": y.detach(), "dx": xs.grad,
                         **{n: p.grad for n, p in module.named_parameters()}})
        results[sequence_parallel] = {"single": outs[0], "tp": outs[1], "mine": mine,
                                      "rows": rows, "halves": halves}
    return results


@pytest.mark.parametrize("name,activation", [("current", "gelu"), ("mxfp8", "swiglu"),
                                             ("nvfp4", "gelu"), ("block", "swiglu")])
def test_layernorm_mlp_two_ranks_equal_one_rank(name, activation):
    for rank, result in enumerate(run_ranks(mlp_worker, 2, name, activation, timeout=180)):
        for sequence_parallel, r in result.items():
            one, tp, mine, rows, halves = (r["single"], r["tp"], r["mine"], r["rows"],
                                           r["halves"])
            where = f"{name} {activation} sp={sequence_parallel} rank {rank}"
            assert torch.equal(tp["fc1_weight"], _slices(one["fc1_weight"], mine, halves)), where
            assert torch.equal(tp["fc1_bias"], _slices(one["fc1_bias"], mine, halves)), where
            assert torch.equal(tp["fc2_weight"], one["fc2_weight"][:, mine]), where
            local = rows if sequence_parallel else slice(None)
            assert close(tp["y"], one["y"][local]), f"{where}: output"
            assert close(tp["dx"], one["dx"][local]), f"{where}: dx"
            assert close(tp["layer_norm_weight"], one["layer_norm_weight"]), f"{where}: norm"
            assert close(tp["fc2_bias"], one["fc2_bias"]), f"{where}: fc2 bias"


def ln_linear_worker(rank: int, world: int, name: str) -> dict:
    group = dist.group.WORLD
    mine = slice(rank * FFN // world, (rank + 1) * FFN // world)
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    results = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        single = mf.LayerNormLinear(HIDDEN, FFN)
        tp = mf.LayerNormLinear(HIDDEN, FFN, tp_group=group, parallel_mode="column",
                                sequence_parallel=sequence_parallel)
        with torch.no_grad():
            tp.weight.copy_(single.weight[mine])
            tp.bias.copy_(single.bias[mine])
        generator = torch.Generator().manual_seed(1)
        x = cpu_randn(TOKENS, HIDDEN, generator=generator) * 3
        dy = cpu_randn(TOKENS, FFN, generator=generator)
        outs = []
        for module, xs, dys, grp in ((single, x, dy, None),
                                     (tp, x[rows] if sequence_parallel else x, dy[:, mine],
                                      group)):
            xs = xs.clone().requires_grad_(True)
            with mf.autocast(recipe=RECIPES[name](), amax_reduction_group=grp):
                y = module(xs)
            y.backward(dys)
            outs.append({"y": y.detach(), "dx": xs.grad,
                         **{n: p.grad for n, p in module.named_parameters()}})
        results[sequence_parallel] = (outs, mine, rows)
    return results


@pytest.mark.parametrize("name", ["current", "block", "nvfp4"])
def test_layernorm_linear_two_ranks_equal_one_rank(name):
    for rank, result in enumerate(run_ranks(ln_linear_worker, 2, name, timeout=180)):
        for sequence_parallel, ((one, tp), mine, rows) in result.items():
            where = f"{name} sp={sequence_parallel} rank {rank}"
            assert torch.equal(tp["y"], one["y"][:, mine]), f"{where}: output"
            assert torch.equal(tp["weight"], one["weight"][mine]), f"{where}: weight grad"
            local = rows if sequence_parallel else slice(None)
            assert close(tp["dx"], one["dx"][local]), f"{where}: dx"
            assert close(tp["layer_norm_weight"], one["layer_norm_weight"]), f"{where}: norm"
            assert close(tp["layer_norm_bias"], one["layer_norm_bias"]), f"{where}: norm bias"


def test_layernorm_linear_refuses_row_parallel():
    with pytest.raises(ValueError, match="column-parallel"):
        mf.LayerNormLinear(8, 8, parallel_mode="row", tp_size=2)


EXPERTS, SPLITS = 3, [32, 0, 96]  # uneven (MXFP8: multiples of 32), one without tokens


def grouped_worker(rank: int, world: int, name: str) -> dict:
    group = dist.group.WORLD
    mine = slice(rank * FFN // world, (rank + 1) * FFN // world)
    results = {}
    for mode in ("column", "row"):
        torch.manual_seed(0)
        single = mf.GroupedLinear(EXPERTS, HIDDEN, FFN)
        tp = mf.GroupedLinear(EXPERTS, HIDDEN, FFN, tp_group=group, parallel_mode=mode)
        with torch.no_grad():
            for expert in range(EXPERTS):
                weight, bias = getattr(single, f"weight{expert}"), getattr(single, f"bias{expert}")
                getattr(tp, f"weight{expert}").copy_(weight[mine] if mode == "column"
                                                     else weight[:, slice(
                                                         rank * HIDDEN // world,
                                                         (rank + 1) * HIDDEN // world)])
                getattr(tp, f"bias{expert}").copy_(bias[mine] if mode == "column" else bias)
        generator = torch.Generator().manual_seed(1)
        x = cpu_randn(TOKENS, HIDDEN, generator=generator) * 3
        dy = cpu_randn(TOKENS, FFN, generator=generator)
        features = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        outs = []
        for module, xs, dys, grp in ((single, x, dy, None),
                                     (tp, x if mode == "column" else x[:, features],
                                      dy[:, mine] if mode == "column" else dy, group)):
            xs = xs.clone().requires_grad_(True)
            with mf.autocast(recipe=RECIPES[name](), amax_reduction_group=grp):
                y = module(xs, SPLITS)
            y.backward(dys)
            outs.append({"y": y.detach(), "dx": xs.grad,
                         **{n: p.grad for n, p in module.named_parameters()}})
        results[mode] = (outs, mine, features)
    return results


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_grouped_linear_experts_sharded_equal_one_rank(name):
    for rank, result in enumerate(run_ranks(grouped_worker, 2, name, timeout=180)):
        for mode, ((one, tp), mine, features) in result.items():
            where = f"{name} {mode} rank {rank}"
            for expert in range(EXPERTS):
                weight = one[f"weight{expert}"]
                want = weight[mine] if mode == "column" else weight[:, features]
                assert torch.equal(tp[f"weight{expert}"], want), f"{where} expert {expert}"
            if mode == "column":
                assert torch.equal(tp["y"], one["y"][:, mine]), f"{where}: output"
                assert close(tp["dx"], one["dx"]), f"{where}: dx"
            else:
                assert torch.equal(tp["dx"], one["dx"][:, features]), f"{where}: dx"
                assert close(tp["y"], one["y"]), f"{where}: output"
                for expert in range(EXPERTS):
                    assert torch.equal(tp[f"bias{expert}"], one[f"bias{expert}"]), where


def integrations_worker(rank: int, world: int, name: str) -> dict:
    """A sequence-parallel LayerNormMLP run plainly, under minifloat.checkpoint (its forward,
    collectives included, recomputed in backward) and with saved tensors offloaded to the CPU
    (save_on_cpu, here a copy on the same device): the same outputs and gradients bitwise."""
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(1)
    x = (cpu_randn(TOKENS, HIDDEN, generator=generator) * 3).chunk(world)[rank]
    dy = cpu_randn(TOKENS, HIDDEN, generator=generator).chunk(world)[rank]
    runs = {}
    for how in ("plain", "checkpoint", "offload"):
        torch.manual_seed(0)
        module = mf.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", tp_group=group,
                                 set_parallel_mode=True, sequence_parallel=True)
        xs = x.clone().requires_grad_(True)
        with mf.autocast(recipe=RECIPES[name]()):
            if how == "checkpoint":
                y = mf.checkpoint(module, xs)
            elif how == "offload":
                with torch.autograd.graph.save_on_cpu():
                    y = module(xs)
            else:
                y = module(xs)
        y.backward(dy)
        runs[how] = [y.detach(), xs.grad, *(p.grad for p in module.parameters())]
    return runs


@pytest.mark.parametrize("name", ["current", "hybrid"])
def test_recompute_and_offload_under_sequence_parallelism(name):
    for rank, runs in enumerate(run_ranks(integrations_worker, 2, name, timeout=180)):
        for how in ("checkpoint", "offload"):
            for index, (a, b) in enumerate(zip(runs[how], runs["plain"], strict=True)):
                assert torch.equal(a, b), f"{name} {how} rank {rank} tensor {index}"
