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
from recipe_factories import FORMAT_RECIPES

from .launch import cpu_randn, device_mesh, run_ranks

RECIPES = {
    **FORMAT_RECIPES,
    "delayed": lambda: mf.DelayedScaling(amax_history_len=2),
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


def layer_pair(rank: int, world: int, mode: str, sequence_parallel: bool, features: int,
               **options) -> tuple[mf.Linear, mf.Linear]:
    """The single-rank Linear (seed 0) and this rank's TP shard of it."""
    torch.manual_seed(0)
    single = mf.Linear(features, features, name="fc")
    tp = mf.Linear(features, features, name="fc", tp_group=dist.group.WORLD,
                   parallel_mode=mode, sequence_parallel=sequence_parallel, **options)
    part = features // world
    mine = slice(rank * part, (rank + 1) * part)
    with torch.no_grad():
        if mode == "column":
            tp.weight.copy_(single.weight[mine])
            tp.bias.copy_(single.bias[mine])
        else:
            tp.weight.copy_(single.weight[:, mine])
            tp.bias.copy_(single.bias)
    return single, tp


def run_pair(rank: int, world: int, name: str, mode: str, sequence_parallel: bool,
             features: int, **options) -> dict:
    single, tp = layer_pair(rank, world, mode, sequence_parallel, features, **options)
    part = features // world
    mine = slice(rank * part, (rank + 1) * part)
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):
        x = cpu_randn(TOKENS, features, generator=generator) * 3
        dy = cpu_randn(TOKENS, features, generator=generator)
        want = _run(single, x, dy, RECIPES[name](), None)
        if mode == "column":
            tp_x, tp_dy = (x[rows] if sequence_parallel else x), dy[:, mine]
        else:
            tp_x, tp_dy = x[:, mine], (dy[rows] if sequence_parallel else dy)
        steps.append({"want": want, "got": _run(tp, tp_x, tp_dy, RECIPES[name](),
                                                dist.group.WORLD)})
        single.zero_grad(set_to_none=True)
        tp.zero_grad(set_to_none=True)
    return {"steps": steps, "mine": (mine.start, mine.stop), "rows": (rows.start, rows.stop)}


def worker(rank: int, world: int, name: str, features: int, cases: list) -> dict:
    """Every (mode, sequence_parallel) case in one launch of the ranks (spawning is the slow
    part of these tests)."""
    return {case: run_pair(rank, world, name, *case, features) for case in cases}


CASES = [("column", False), ("column", True), ("row", False), ("row", True)]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within fp32 summation order (a sum over ranks against one GEMM's accumulation). On a GPU
    the forward FP8 GEMMs accumulate with Hopper's fast accumulation (fewer mantissa bits than
    fp32, promoted at intervals), so the partial sums over K / ranks and the whole-K GEMM
    differ by more: the bound there is 1e-3 of the largest value (measured: 3e-4)."""
    tolerance = 1e-3 if a.is_cuda else 1e-5
    return torch.allclose(a, b, rtol=tolerance, atol=tolerance * float(b.abs().max()))


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
def test_two_ranks_equal_one_rank(name):
    results = run_ranks(worker, 2, name, FEATURES, CASES, timeout=180)
    for case in CASES:
        check([r[case] for r in results], *case, f"{name} {case}")


def test_four_ranks_equal_one_rank():
    cases = [("column", True), ("row", True)]
    results = run_ranks(worker, 4, "current", 512, cases, timeout=180)
    for case in cases:
        check([r[case] for r in results], *case, f"current {case} 4 ranks")


def original_input_worker(rank: int, world: int, names: list[str]) -> dict:
    return {(name, *case): run_pair(rank, world, name, *case, FEATURES, save_original_input=True)
            for name in names for case in CASES}


def test_original_inputs_under_tensor_parallelism_equal_one_rank():
    """save_original_input on the TP layers (the single-rank layer keeps its copies): the
    backward's recast of a sharded input takes the amax reduced over the group again (current
    scaling), forward's scale (delayed), or its own blocks (MXFP8); a sequence-parallel input
    is gathered as bytes and keeps them. Same checks as without the option."""
    names = ["current", "delayed", "mxfp8"]
    results = run_ranks(original_input_worker, 2, names, timeout=180)
    for name in names:
        for case in CASES:
            check([r[(name, *case)] for r in results], *case, f"{name} {case} original input")


def no_reduction_worker(rank: int, world: int) -> dict:
    return run_pair(rank, world, "current", "column", False, FEATURES, tp_amax_reduction=False)


def test_without_amax_reduction_shards_scale_alone_within_fp8_rounding():
    """tp_amax_reduction=False: each rank scales its weight and gradient shard by its own amax,
    so results are not the single rank's bytes, but within FP8 rounding of them: the stated
    tolerance is a relative error norm below 0.1 (E4M3 and E5M2 rounding)."""
    results = run_ranks(no_reduction_worker, 2, timeout=120)
    differs = False
    for result in results:
        mine = slice(*result["mine"])
        for pair in result["steps"]:
            (y, _, dw, _), (ty, _, tdw, _) = pair["want"], pair["got"]
            for got, want in ((ty, y[:, mine]), (tdw, dw[mine])):
                differs |= not torch.equal(got, want)
                assert (got - want).norm() / want.norm() < 0.1
    assert differs  # the option is what makes the shards bitwise equal to one rank


def pickle_worker(rank: int, world: int) -> bool:
    _, tp = layer_pair(rank, world, "column", False, FEATURES)
    restored = pickle.loads(pickle.dumps(tp))
    assert restored.tp.group is None
    x = torch.randn(16, FEATURES)
    with mf.autocast(recipe=mf.Float8CurrentScaling()):
        try:
            restored(x)
        except RuntimeError as error:
            assert "set_tensor_parallel_group" in str(error) and "pickled" in str(error)
        else:
            raise AssertionError("a TP module without its group ran")
        restored.set_tensor_parallel_group(dist.group.WORLD)
        return torch.equal(restored(x), tp(x))


def test_pickling_drops_the_group_and_says_how_to_set_it():
    assert all(run_ranks(pickle_worker, 2, timeout=120))


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="parallel_mode"):
        mf.Linear(8, 8, parallel_mode="diagonal", tp_size=2)
    with pytest.raises(ValueError, match="does not split over tp_size 3"):
        mf.Linear(8, 8, parallel_mode="column", tp_size=3)
    with pytest.raises(ValueError, match="sequence_parallel needs"):
        mf.Linear(8, 8, sequence_parallel=True, tp_size=2)


def two_groups_worker(rank: int, world: int) -> list[bool]:
    """Two column-parallel layers over two different TP groups of a 2x2 mesh (seed 003's
    bug: the groups must never override each other); each rank's output and weight-gradient
    slices of both equal the single-rank layers' bitwise."""
    mesh = device_mesh((2, 2), names=("a", "b"))
    recipe = mf.Float8CurrentScaling()
    generator = torch.Generator().manual_seed(4)
    x = cpu_randn(TOKENS, FEATURES, generator=generator)
    same = []
    for dim, scale in (("a", 10.0), ("b", 30.0)):
        group = mesh[dim].get_group()
        local = mesh[dim].get_local_rank()
        torch.manual_seed(0)
        single = mf.Linear(FEATURES, FEATURES, name=dim)
        with torch.no_grad():  # the amax sits in the second shard, different per layer
            single.weight[FEATURES // 2:] *= scale
        tp = mf.Linear(FEATURES, FEATURES, name=dim, tp_group=group, parallel_mode="column")
        mine = slice(local * FEATURES // 2, (local + 1) * FEATURES // 2)
        with torch.no_grad():
            tp.weight.copy_(single.weight[mine])
            tp.bias.copy_(single.bias[mine])
        dy = cpu_randn(TOKENS, FEATURES, generator=generator)
        y, _, dw, _ = _run(single, x, dy, recipe, None)
        ty, _, tdw, _ = _run(tp, x, dy[:, mine], recipe, group)
        same += [torch.equal(ty, y[:, mine]), torch.equal(tdw, dw[mine])]
    return same


def test_two_tensor_parallel_groups_never_override_each_other():
    for rank, same in enumerate(run_ranks(two_groups_worker, 4, timeout=180)):
        assert all(same), f"rank {rank}: {same}"


def gather_dtype_worker(rank: int, world: int, name: str) -> dict:
    """Which dtypes the sequence-parallel all-gathers moved, and the TP results (checked
    against one rank like the other tests)."""
    from minifloat.distributed import sequence_gather, tensor_parallel

    seen = []

    def spy(original):
        def gather(x, group):
            seen.append(str(x.dtype))
            return original(x, group)
        return gather

    sequence_gather._all_gather_dim0 = spy(sequence_gather._all_gather_dim0)
    tensor_parallel._all_gather_dim0 = spy(tensor_parallel._all_gather_dim0)
    result = run_pair(rank, world, name, "column", True, FEATURES)
    return {"result": result, "dtypes": seen}


BYTES, SCALES = "torch.uint8", "torch.float32"  # codes (and 8-bit scales), fp32 scale_inv


@pytest.mark.parametrize("name,dtypes", [("current", {BYTES}), ("delayed", {BYTES}),
                                         ("mxfp8", {BYTES}), ("block", {BYTES, SCALES}),
                                         ("nvfp4", {BYTES}), ("hybrid", {SCALES})])
def test_sequence_parallel_gathers_quantized_bytes_where_the_format_allows(name, dtypes):
    """Per-tensor FP8 inputs travel as one-byte codes (each rank quantizes its rows with the
    amax reduced over the group, or delayed scaling's scale); block formats whose blocks do
    not cross ranks as the codes and scales of both copies (1x128 blocks: fp32 scale_inv);
    and the results stay the single rank's bit for bit. A hybrid input gathers in high
    precision (fp32 here: the CPU runs in fp32)."""
    results = run_ranks(gather_dtype_worker, 2, name, timeout=120)
    check([r["result"] for r in results], "column", True, f"{name} gather")
    for result in results:
        assert result["dtypes"] and set(result["dtypes"]) == dtypes, result["dtypes"]


def row_gather_dtype_worker(rank: int, world: int, name: str) -> dict:
    """A sequence-parallel row-parallel layer: backward gathers the output gradient's rows."""
    from minifloat.distributed import sequence_gather

    seen = []
    original = sequence_gather._all_gather_dim0

    def gather(x, group):
        seen.append(str(x.dtype))
        return original(x, group)

    sequence_gather._all_gather_dim0 = gather
    result = run_pair(rank, world, name, "row", True, FEATURES)
    return {"result": result, "dtypes": seen}


@pytest.mark.parametrize("name,dtypes", [("current", {BYTES}), ("mxfp8", {BYTES}),
                                         ("block", {BYTES, SCALES})])
def test_sequence_parallel_gathers_the_output_gradient_as_fp8_bytes(name, dtypes):
    results = run_ranks(row_gather_dtype_worker, 2, name, timeout=120)
    check([r["result"] for r in results], "row", True, f"{name} row gather")
    for result in results:
        assert result["dtypes"] and set(result["dtypes"]) == dtypes, result["dtypes"]


def compiled_worker(rank: int, world: int) -> dict:
    """The TP layer compiled (aot_eager, fullgraph) against the single-rank layer run eagerly.
    FP8 current scaling with its casts traced (graph_casts on, the lean path widened to the CPU,
    as tests/compile does) reduces the split operands' maxima inside the graph (functional
    collectives); elsewhere the GEMM ops reduce them inside the op, as eager does (current
    scaling, NVFP4's global amax); block formats have none to reduce. (Delayed scaling is
    compared off the widened lean path: there the single rank's CPU lean path and the TP
    layer's reference path record different maxima; on GPUs the NCCL run of
    test_two_ranks_equal_one_rank compares those two paths and they agree.)"""
    from minifloat.modules import graph_casts, lean_fp8

    global layer_pair
    eager_pair = layer_pair

    def compiled_pair(*args, **kwargs):
        torch._dynamo.reset()  # a new layer each case: no recompile limit across cases
        single, tp = eager_pair(*args, **kwargs)
        return single, torch.compile(tp, backend="aot_eager", fullgraph=True)

    layer_pair = compiled_pair
    results, graphs = {}, {}
    for name, widened in COMPILED_CASES:
        lean_fp8.DEVICES = ("cuda", "cpu") if widened else ("cuda",)
        graph_casts.ENABLED = True if widened else None  # the casts traced, or the ops
        cases = CASES if widened else [("column", False), ("row", False)]
        for case in cases:
            torch._dynamo.utils.counters.clear()
            results[(name, widened, *case)] = run_pair(rank, world, name, *case, FEATURES)
            graphs[(name, widened, *case)] = torch._dynamo.utils.counters["stats"][
                "unique_graphs"]
    return {"results": results, "graphs": graphs}


COMPILED_CASES = [("current", True), ("current", False), ("delayed", False), ("block", False),
                  ("mxfp8", False), ("nvfp4", False), ("hybrid", False)]


def test_compiled_layers_reduce_the_split_maxima_in_the_graph():
    """...in one graph per layer: the second step recompiles nothing."""
    outcomes = run_ranks(compiled_worker, 2, timeout=300)
    for key in outcomes[0]["results"]:
        check([r["results"][key] for r in outcomes], *key[2:], f"compiled {key}")
        assert all(r["graphs"][key] == 1 for r in outcomes), (key, outcomes[0]["graphs"])


def _mapping_inputs(world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's input (rank r seeds its own) and the shared weight."""
    inputs = [cpu_randn(8, 16, generator=torch.Generator().manual_seed(rank))
              for rank in range(world)]
    return inputs, cpu_randn(16, 16, generator=torch.Generator().manual_seed(7))


def compiled_mappings_worker(rank: int, world: int) -> dict:
    """The four TP mappings in `(mapping(x) @ w).sin()`, eager and compiled (fullgraph): output
    and input gradient of each."""
    from minifloat.distributed import tensor_parallel as tp

    group = dist.group.WORLD
    inputs, weight = _mapping_inputs(world)
    mappings = {"copy": tp.copy_to_tensor_parallel, "reduce": tp.reduce_from_tensor_parallel,
                "gather": tp.gather_along_sequence,
                "scatter": tp.reduce_scatter_along_sequence}
    out = {}
    for name, mapping in mappings.items():
        def step(t, mapping=mapping):
            return (mapping(t, group) @ weight).sin()
        runs = []
        for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
            leaf = inputs[rank].clone().requires_grad_(True)
            y = fn(leaf)
            y.backward(torch.ones_like(y))
            runs.append((y.detach().cpu(), leaf.grad.cpu()))
        out[name] = runs
    return out


def _one_process_mappings(rank: int, world: int) -> dict:
    """What rank `rank` must get from each mapping, computed in one process from every rank's
    input with no collective (y = sin(z W), its gradient cos(z W) W^T)."""
    inputs, weight = _mapping_inputs(world)
    inputs, weight = [t.cpu() for t in inputs], weight.cpu()

    def forward_backward(z):
        return (z @ weight).sin(), (z @ weight).cos() @ weight.t()

    count = inputs[0].shape[0]
    rows = count // world  # a rank's rows of the reduce-scattered sum
    mine = slice(rank * rows, (rank + 1) * rows)
    own = slice(rank * count, (rank + 1) * count)  # a rank's rows of the gathered sequence
    total = sum(inputs)
    gathered = torch.cat(inputs)
    return {
        # identity forward, input gradient summed over the ranks' own outputs
        "copy": (forward_backward(inputs[rank])[0],
                 sum(forward_backward(x)[1] for x in inputs)),
        # summed forward, identity backward
        "reduce": forward_backward(total),
        # the whole sequence forward; backward sums every rank's (equal) gradient, keeps my rows
        "gather": (forward_backward(gathered)[0], world * forward_backward(gathered)[1][own]),
        # my rows of the sum forward; backward gathers every rank's rows' gradient
        "scatter": (forward_backward(total[mine])[0],
                    torch.cat([forward_backward(total[slice(r * rows, (r + 1) * rows)])[1]
                               for r in range(world)])),
    }


def test_compiled_mappings_equal_eager():
    """Each mapping, eagerly, gives one process's result (within fp32 summation order), and
    compiled gives eager's output and input gradient bitwise. Under NCCL on torch 2.11 the
    in-place reduce-scatter that dynamo rewrote in the gather's backward gave a zero input
    gradient (2 x H200); the compiled mappings now call the functional collectives."""
    for rank, result in enumerate(run_ranks(compiled_mappings_worker, 2, timeout=120)):
        want = _one_process_mappings(rank, 2)
        for name, ((y, dx), (cy, cdx)) in result.items():
            assert close(y, want[name][0]) and close(dx, want[name][1]), f"{name}: eager"
            assert torch.equal(cy, y), f"{name}: compiled output"
            assert dx.abs().sum() > 0 and torch.equal(cdx, dx), f"{name}: compiled gradient"
