"""The compiled lean path takes current scaling's amax from the traced graph.

Under torch.compile, the lean FP8 path's current-scaling casts of a GEMM's input (forward) and
grad_output (backward) get max|x| computed in torch ops inside the graph
(lean_ops.compiled_amax), so that inductor fuses the reduction into the kernel that produces x
instead of the cast reading x twice. The maximum is exact, so the bytes must not change: here,
without a GPU, the lean path is widened to the CPU (lean_fp8.DEVICES), where its casts use the
given amax (the reference's cast, numerics.quantize_current_scaling), and the compiled step is
compared with the eager one bit for bit (aot_eager: the same torch ops), and under inductor
every amax handed over is checked against the tensor the op then casts.
"""

from __future__ import annotations

import pytest
import torch
from test_compile import _step

import minifloat as mf
from minifloat.modules import lean_fp8, lean_ops


@pytest.fixture
def given_amaxes(monkeypatch):
    """The lean path on CPU tensors; records the amax each compiled op call was given."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    seen = {"forward": [], "backward": []}
    forward, backward = lean_ops.lean_forward, lean_ops.lean_backward

    def given(amax, x):  # (the amax handed over, max|x| of the tensor the op casts)
        return None if amax is None else (amax.clone(), x.detach().abs().amax().float())

    def recording_forward(*args):
        seen["forward"].append(given(args[7] if len(args) > 7 else None, args[0]))
        return forward(*args)

    def recording_backward(*args):
        seen["backward"].append(given(args[8] if len(args) > 8 else None, args[0]))
        return backward(*args)

    monkeypatch.setattr(lean_ops, "lean_forward", recording_forward)
    monkeypatch.setattr(lean_ops, "lean_backward", recording_backward)
    return seen


class Block(torch.nn.Module):
    """An MLP whose GEMM inputs are a norm's and a GELU's outputs, as in a transformer."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(64)
        self.fc1 = mf.Linear(64, 128)
        self.fc2 = mf.Linear(128, 64)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _results(model, x, dy, recipe):
    y, dx, grads = _step(model, recipe, x, dy, seed=0)
    return [y, dx, *grads]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_casts_take_the_graphs_amax_and_keep_the_bytes(given_amaxes, backend):
    torch.manual_seed(0)
    model = Block()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 64, generator=generator) * 3
    dy = torch.randn(4, 16, 64, generator=generator)
    recipe = mf.Float8CurrentScaling()
    eager = _results(model, x, dy, recipe)
    assert given_amaxes["forward"] == [] and given_amaxes["backward"] == []  # eager: no ops
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = _results(compiled, x, dy, recipe)
    for name, a, b in zip(["y", "dx", "norm", "fc1.w", "fc1.b", "fc2.w", "fc2.b"], got, eager,
                          strict=True):
        if backend == "aot_eager":  # the same ops as eager: bit for bit
            assert torch.equal(a, b), name
        else:  # inductor's own norm and GELU code rounds differently in fp32
            assert torch.allclose(a, b, rtol=0.05, atol=0.05), name
    # both GEMMs, forward and backward, were handed the maximum of what they cast
    assert len(given_amaxes["forward"]) == 2 and len(given_amaxes["backward"]) == 2
    for amax, actual in given_amaxes["forward"] + given_amaxes["backward"]:
        assert amax.shape == (1,) and amax.dtype == torch.float32
        assert torch.equal(amax, actual.reshape(1))


@pytest.mark.parametrize("recipe, expected", [(mf.Float8CurrentScaling(), 2),
                                              (mf.DelayedScaling(), 0)],
                         ids=["current", "delayed"])
def test_the_forward_graph_holds_one_maximum_per_current_scaling_gemm(given_amaxes, recipe,
                                                                      expected):
    """Dynamo's forward graph takes max|x| for each GEMM whose input is cast with current
    scaling (two here), and none under delayed scaling, whose casts use the recipe state's
    scales."""
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.manual_seed(0)
    compiled = torch.compile(Block(), backend=recording, fullgraph=True)
    _results(compiled, torch.randn(2, 16, 64), torch.randn(2, 16, 64), recipe)
    (graph,) = graphs
    maxima = [node for node in graph.graph.nodes if node.target in (torch.amax, "amax")]
    assert len(maxima) == expected, graph.code
