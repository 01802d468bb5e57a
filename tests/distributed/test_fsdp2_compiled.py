"""FSDP2 with low-precision all-gather under torch.compile (each block compiled, fullgraph).

The gathered weights are QuantizedTensor parameters; compiled blocks take them as their buffers
(QuantizedTensor.__tensor_flatten__) and the GEMM ops' twins run on those buffers
(modules/quantized_weight_ops.py). With the aot_eager backend the compiled run executes the same
ops as the eager one, so two ranks must train bit for bit as eagerly: losses and the sharded
parameters after each step. Delayed-scaling and MXFP8 gathers, which a compiled graph cannot
run correctly, and hybrid gathers (a format per direction), must say so; MXFP8 weights kept
gathered from forward to backward compile.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

import minifloat as mf
from minifloat.distributed import enable_low_precision_all_gather

from .launch import cpu_randn, device_mesh, run_ranks

HIDDEN = 256
RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "block": lambda: mf.Float8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}


def _build(recipe: mf.Recipe, world_size: int, compiled: bool, kept: bool = False
           ) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        mf.LayerNormLinear(HIDDEN, HIDDEN, normalization="RMSNorm", name="qkv"),
        mf.LayerNormMLP(HIDDEN, HIDDEN, normalization="RMSNorm", name="mlp"))
    enable_low_precision_all_gather(model, recipe)
    return _sharded(model, world_size, compiled, kept)


def _sharded(model: nn.Sequential, world_size: int, compiled: bool, kept: bool = False
             ) -> nn.Module:
    """kept: blocks keep their gathered weights for backward (reshard_after_forward=False)."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh((world_size,))
    for block in model:
        if compiled:  # as users of FSDP2 compile: each block, then shard it
            block.compile(backend="aot_eager", fullgraph=True)
        fully_shard(block, mesh=mesh, reshard_after_forward=not kept)
    fully_shard(model, mesh=mesh)
    return model


def _losses(model: nn.Module, recipe: mf.Recipe, rank: int, world_size: int, rows: int,
            hidden: int, after_step=None) -> list[torch.Tensor]:
    """Two AdamW steps on this rank's rows of a global batch; `after_step()` after each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x = cpu_randn(world_size * rows, hidden, generator=generator).chunk(world_size)[rank]
        with mf.autocast(recipe=recipe):
            loss = model(x.requires_grad_(True)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        if after_step is not None:
            after_step()
    return losses


def _train(rank: int, world_size: int, name: str, compiled: bool, kept: bool = False) -> dict:
    recipe = RECIPES[name]() if name in RECIPES else mf.MXFP8BlockScaling()
    model = _build(recipe, world_size, compiled, kept)
    params = []

    def keep_params() -> None:
        params.append([p.to_local()._inner.clone() for p in model.parameters()
                       if hasattr(p.to_local(), "_inner")])

    return {"losses": _losses(model, recipe, rank, world_size, 64, HIDDEN, keep_params),
            "params": params}


def _refusal(recipe: mf.Recipe, world_size: int) -> str:
    """The error a compiled step of a model with these gathered weights raises (every rank
    runs it: building the mesh and the first gather are collective)."""
    torch._dynamo.reset()
    model = _build(recipe, world_size, compiled=True)
    try:
        with mf.autocast(recipe=recipe):
            model(torch.randn(64, HIDDEN, requires_grad=True)).sum().backward()
    except Exception as error:  # noqa: BLE001 - dynamo wraps the library's error
        return f"{type(error).__name__}: {error}"
    return "no error"


def worker(rank: int, world_size: int) -> dict:
    results = {}
    for name in RECIPES:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = _train(rank, world_size, name, compiled=True)
        results[name] = {"eager": _train(rank, world_size, name, compiled=False),
                         "compiled": compiled,
                         "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                         "breaks": sum(torch._dynamo.utils.counters["graph_break"].values())}
    results["delayed"] = _refusal(mf.DelayedScaling(), world_size)
    results["mxfp8"] = _refusal(mf.MXFP8BlockScaling(), world_size)
    results["hybrid"] = _refusal(mf.HybridRecipe(
        fprop=mf.Float8CurrentScaling(), dgrad=mf.Float8BlockScaling(),
        wgrad=mf.Float8CurrentScaling()), world_size)
    return results


def test_compiled_blocks_train_like_eager_with_low_precision_gathers():
    results = run_ranks(worker, 2, timeout=300)
    for rank, result in enumerate(results):
        for name in RECIPES:
            eager, compiled = result[name]["eager"], result[name]["compiled"]
            assert result[name]["breaks"] == 0, (rank, name)
            # one graph per block kind, and none again for the next step or layer
            assert result[name]["graphs"] <= 2, (rank, name, result[name]["graphs"])
            for step, (a, b) in enumerate(zip(compiled["losses"], eager["losses"],
                                              strict=True)):
                assert torch.equal(a, b), (rank, name, step)
            for step, (mine, theirs) in enumerate(zip(compiled["params"], eager["params"],
                                                      strict=True)):
                assert len(mine) == 3
                for a, b in zip(mine, theirs, strict=True):
                    assert torch.equal(a, b), (rank, name, step)
    for result in results:
        assert "delayed-scaling weights does not run under torch.compile" in result["delayed"]
        assert "gather MXFP8 weights in high precision" in result["mxfp8"]
        assert "hybrid quantized weights (a format per direction)" in result["hybrid"]


def _graph_casts_worker(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """FSDP2 gathering in high precision, each block compiled, with the casts in the traced
    graph (modules/graph_casts.py; on the CPU the lean path is widened to it): losses of two
    steps, eager then compiled."""
    from minifloat.modules import graph_casts, lean_fp8

    lean_fp8.DEVICES = ("cuda", "cpu")
    graph_casts.ENABLED = True
    recipe = mf.Float8CurrentScaling()
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _sharded(nn.Sequential(mf.LayerNormMLP(64, 128, normalization="RMSNorm")),
                         world_size, compiled)
        runs.append(_losses(model, recipe, rank, world_size, 32, 64))
    return runs


def test_graph_casts_under_fsdp2_train_like_eager():
    for eager, compiled in run_ranks(_graph_casts_worker, 2, timeout=240):
        for step, (a, b) in enumerate(zip(compiled, eager, strict=True)):
            assert torch.equal(a, b), step


def kept_mxfp8_worker(rank: int, world_size: int) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _train(rank, world_size, "mxfp8", compiled=True, kept=True)
    return {"eager": _train(rank, world_size, "mxfp8", compiled=False, kept=True),
            "compiled": compiled,
            "breaks": sum(torch._dynamo.utils.counters["graph_break"].values())}


def test_compiled_blocks_keeping_mxfp8_weights_gathered_train_like_eager():
    """Kept gathered, MXFP8 weights gather both copies in forward and no re-gather follows, so
    the compiled backward's copy is forward's: compiling is allowed and bitwise eager's."""
    for rank, result in enumerate(run_ranks(kept_mxfp8_worker, 2, timeout=240)):
        eager, compiled = result["eager"], result["compiled"]
        assert result["breaks"] == 0, rank
        for a, b in zip(compiled["losses"], eager["losses"], strict=True):
            assert torch.equal(a, b), rank
        for mine, theirs in zip(compiled["params"], eager["params"], strict=True):
            assert len(mine) == 3
            for a, b in zip(mine, theirs, strict=True):
                assert torch.equal(a, b), rank
