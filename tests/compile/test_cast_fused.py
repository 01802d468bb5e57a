"""The opt-in cast-fused route under torch.compile (modules/cast_fused_gemm.py,
MINIFLOAT_COMPILED_INPUT_CAST=1): the per-tensor input cast in torch ops ahead of the GEMM op.

It must compute what eager computes, bit for bit (aot_eager), with and without the memory
options, for every module type it serves; the traced forward must hold the cast-fused op (the
route was taken); inductor's code for it is checked within bf16 tolerance in test_compile.py.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from test_compile import RECIPES, _assert_trains_like_eager, _build, _data, _dy_like, _step
from torch._dynamo.backends.common import aot_autograd

import minifloat as mf
from minifloat.modules import cast_fused_gemm

pytestmark = pytest.mark.filterwarnings("error:Accessing the data pointer of FakeTensor")


@pytest.fixture(autouse=True)
def cast_fused(monkeypatch):
    monkeypatch.setattr(cast_fused_gemm, "ENABLED", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording_backend(graphs: list[str]):
    """aot_eager's work (no code generation), with the default min-cut partitioner, recording
    each forward graph's code."""

    def forward_compiler(graph, _inputs):
        graphs.append(graph.code)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=forward_compiler,
                        bw_compiler=lambda graph, _: make_boxed_func(graph.forward),
                        partition_fn=min_cut_rematerialization_partition)


@pytest.mark.parametrize("lowest_memory", [False, True])
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp",
                                  "convert_model"])
def test_cast_fused_route_equals_eager_bitwise(kind, lowest_memory):
    recipe = RECIPES["current"]
    eager = _build(kind)
    model = _build(kind)
    if lowest_memory:
        mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(model))
    graphs: list[str] = []
    compiled = torch.compile(model, backend=_recording_backend(graphs), fullgraph=True)
    _assert_trains_like_eager(eager, compiled, recipe, kind)
    assert graphs and all("gemms_forward_quantized" in code for code in graphs)
    assert not any("minifloat.gemms_forward.default" in code for code in graphs)


def test_other_recipes_keep_the_default_route():
    """Delayed scaling (stateful) and the block formats are not served."""
    for name in ("delayed", "mxfp8"):
        torch._dynamo.reset()
        graphs: list[str] = []
        model = torch.compile(_build("linear"), backend=_recording_backend(graphs),
                              fullgraph=True)
        _step(model, RECIPES[name], _data(1), _dy_like(_build("linear"), _data(0)), seed=0)
        assert graphs and not any("gemms_forward_quantized" in code for code in graphs), name
