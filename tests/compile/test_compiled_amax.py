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
from minifloat.modules import graph_casts, lean_fp8, lean_ops


@pytest.fixture
def given_amaxes(monkeypatch):
    """The lean path on CPU tensors; records the amax each compiled op call was given. The ops,
    not the graph casts, which inductor without CUDA graphs would take by default."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(graph_casts, "ENABLED", False)
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


def _low_memory(model: torch.nn.Module) -> torch.nn.Module:
    return mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(model))


@pytest.mark.parametrize("low_memory", [False, True], ids=["copies", "low-memory"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_casts_take_the_graphs_amax_and_keep_the_bytes(given_amaxes, backend,
                                                                low_memory):
    """Also with the memory options, where forward casts its input rowwise only and the
    backward formula makes the columnwise copy from forward's amax (input_recast.py)."""
    torch.manual_seed(0)
    model = _low_memory(Block()) if low_memory else Block()
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


def test_the_low_memory_backward_takes_no_maximum_of_the_recomputed_input(given_amaxes):
    """With save_original_input, backward casts the input again; forward's max|x| is handed
    to it, so the backward graph takes only the two grad_outputs' maxima (four before: each
    recast took the maximum of the recomputed input again)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(graph, _inputs):
            graphs[name] = graph
            return make_boxed_func(graph.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    compiled = torch.compile(_low_memory(Block()), backend=backend, fullgraph=True)
    _results(compiled, torch.randn(2, 16, 64), torch.randn(2, 16, 64), mf.Float8CurrentScaling())

    def maxima(graph):
        return [node for node in graph.graph.nodes
                if node.target in (torch.ops.aten.amax.default, torch.ops.aten.max.default)]

    assert len(maxima(graphs["forward"])) == 2, graphs["forward"].code
    assert len(maxima(graphs["backward"])) == 2, graphs["backward"].code


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_maximum_over_magnitude_bits_is_torchs_amax(dtype):
    """The maximum taken over the integer view (input_recast.magnitude_bits, the MoE group
    maxima's form) is torch.amax(x.abs()) for every kind of value: binades far apart,
    subnormals, -0, inf, and NaN of either sign propagating."""
    from minifloat.modules.input_recast import magnitude_bits, maximum_of_bits

    def maximum(x):
        return maximum_of_bits(torch.amax(magnitude_bits(x)), x.dtype)

    g = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    x = (torch.randn(64, 33, generator=g)
         * torch.exp2(torch.randint(-14, 10, (64, 33), generator=g).float())).to(dtype)
    x[0, 0], x[1, 1] = -info.max, info.tiny / 4  # the largest magnitude is negative
    assert torch.equal(maximum(x), x.abs().amax().float())
    assert maximum(x).item() == info.max
    for special in (-float("inf"), float("nan"), -float("nan")):
        y = x.clone()
        y[5, 7] = special
        torch.testing.assert_close(maximum(y), y.abs().amax().float(), rtol=0, atol=0,
                                   equal_nan=True)
    assert maximum(torch.full((3, 4), -0.0, dtype=dtype)).item() == 0.0
    assert magnitude_bits(x.double()) is None
