"""save_original_input and rebuild_weight_copy_in_backward under torch.compile (fullgraph).

With both, the compiled forward keeps no quantized copy for backward: the backward formula of
the GEMM op casts the input again in torch ops (modules/input_recast.py) and the backward op
casts the weights again. Results must equal eager (which keeps its copies) bit for bit with the
aot_eager backend, under every recipe (test_compile.py's
test_compiled_ops_rebuild_weight_copies_in_backward); and inductor's min-cut partitioner must
then keep nothing one byte wide for backward, where by default it keeps every copy: the norm's
and the activation's outputs are recomputed in backward from what those keep anyway, which is
where the activation memory goes (benchmarks/memory_probe.py measures it on the GPU).
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from test_compile import RECIPES, _assert_bitwise, _build, _data, _dy_like, _step
from torch._dynamo.backends.common import aot_autograd

import minifloat as mf

pytestmark = pytest.mark.filterwarnings("error:Accessing the data pointer of FakeTensor")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each case compiles its own modules: no earlier case's graphs count to the recompile
    limit of the shared forward code."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _lowest_memory(model: torch.nn.Module) -> torch.nn.Module:
    return mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(model))


def _kept_for_backward(model: torch.nn.Module, recipe: mf.Recipe) -> list[torch.Tensor]:
    """The tensors the min-cut partitioner (inductor's) keeps from forward for backward, other
    than the graph's inputs (parameters and the input, alive anyway)."""
    kept = []

    def forward_compiler(graph, _inputs):
        output = next(node for node in graph.graph.nodes if node.op == "output")
        kept.extend(node.meta["val"] for node in output.args[0]
                    if getattr(node, "op", None) != "placeholder"
                    and isinstance(getattr(node, "meta", {}).get("val"), torch.Tensor))
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=forward_compiler,
                           bw_compiler=lambda graph, _: make_boxed_func(graph.forward),
                           partition_fn=min_cut_rematerialization_partition)
    x = _data(0).requires_grad_(True)
    with mf.autocast(recipe=recipe):
        y = torch.compile(model, backend=backend, fullgraph=True)(x)
    y.sum().backward()
    return kept[1:]  # the first output is the model's


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_partitioner_keeps_no_quantized_copy_and_recomputes_the_inputs(recipe_name):
    """Delayed scaling too: the forward op hands backward forward's scales (1 element each)."""
    recipe = RECIPES[recipe_name]
    default = _kept_for_backward(_build("convert_model"), recipe)
    lowest = _kept_for_backward(_lowest_memory(_build("convert_model")), recipe)
    one_byte = [t for t in default if t.element_size() == 1]
    assert len(one_byte) == 4  # two inputs' and two weights' copies
    assert [t for t in lowest if t.element_size() == 1] == []
    # the inputs are not kept in high precision instead: less is allocated for backward
    assert (sum(t.numel() * t.element_size() for t in lowest)
            < sum(t.numel() * t.element_size() for t in default))


def test_a_deep_copied_model_compiles():
    """copy.deepcopy makes a module without running __init__: the copy must still be bound
    before dynamo traces it (a binding made while tracing fails on torch 2.11: dynamo cannot
    trace the dataclass repr it takes)."""
    import copy

    from minifloat.modules.base import _LIVE_MODULES

    recipe = RECIPES["current"]
    original = _build("convert_model")
    _step(original, recipe, _data(0), _dy_like(original, _data(0)), seed=0)
    copied = copy.deepcopy(original)
    assert copied.fc1 in _LIVE_MODULES and copied.fc2 in _LIVE_MODULES
    compiled = torch.compile(copied, backend="aot_eager", fullgraph=True)
    dy = _dy_like(original, _data(1))
    want = _step(original, recipe, _data(1), dy, seed=1)
    got = _step(compiled, recipe, _data(1), dy, seed=1)
    _assert_bitwise(got[0], want[0], "y")


def test_compile_caches_are_keyed_by_minifloat_source(tmp_path):
    """A changed source file changes the tag minifloat adds to torch's cache key, so a graph
    compiled against other code is never replayed (compile_cache.py)."""
    from minifloat import compile_cache

    assert compile_cache.source_tag() in torch.compiler.config.cache_key_tag.split()
    for name, text in (("a", "x = 1\n"), ("b", "x = 2\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(text)
    assert compile_cache.source_tag(tmp_path / "a") != compile_cache.source_tag(tmp_path / "b")
