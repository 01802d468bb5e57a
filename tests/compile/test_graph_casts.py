"""MINIFLOAT_GRAPH_CASTS: compiled FP8 current scaling with every cast in the traced graph.

Without a GPU the lean path is widened to the CPU (lean_fp8.DEVICES), where eager runs it with
the reference's casts; the graph path makes the same casts in torch ops
(input_recast.per_tensor_cast) and the same torch._scaled_mm calls. So with aot_eager (the
traced torch ops, no inductor codegen) the compiled step must equal the eager one bit for bit,
with and without the memory options; under inductor, its own norm and GELU code rounds
differently, so there the results are close and the graph is checked instead.
"""

from __future__ import annotations

import pytest
import torch
from test_compile import _step

import minifloat as mf
from minifloat.modules import graph_casts, lean_fp8


@pytest.fixture(autouse=True)
def graph_casts_on_the_cpu(monkeypatch):
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(graph_casts, "ENABLED", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    """An MLP whose GEMM inputs are a norm's and a GELU's outputs, as in a transformer."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.norm = torch.nn.RMSNorm(64)
        self.fc1 = mf.Linear(64, 128, bias=bias)
        self.fc2 = mf.Linear(128, 64, bias=bias)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _low_memory(model: torch.nn.Module) -> torch.nn.Module:
    return mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(model))


def _data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 64, generator=generator) * 3
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, 5e4])  # zeros, a tiny and a large value
    return x, torch.randn(4, 16, 64, generator=generator)


def _results(model, recipe):
    x, dy = _data()
    y, dx, grads = _step(model, recipe, x, dy, seed=0)
    return [y, dx, *grads]


def _recording_backend(graphs: list):
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    return backend


@pytest.mark.parametrize("low_memory", [False, True], ids=["copies", "low-memory"])
@pytest.mark.parametrize("recipe, bias", [
    (mf.Float8CurrentScaling(), True),  # HYBRID: E5M2 gradients
    (mf.Float8CurrentScaling(fp8_format=mf.Format.E4M3), False)], ids=["hybrid-bias", "e4m3"])
def test_graph_casts_equal_eager_bitwise(low_memory, recipe, bias):
    torch.manual_seed(0)
    model = Block(bias)
    if low_memory:
        model = _low_memory(model)
    eager = _results(model, recipe)
    compiled = _results(torch.compile(model, backend="aot_eager", fullgraph=True), recipe)
    for index, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert torch.equal(a, b), f"tensor {index}"


def _op_names(graph: torch.fx.GraphModule) -> list[str]:
    """The ops the graph calls, those of its subgraphs (an autograd.Function's forward and
    backward bodies) included."""
    return [str(node.target) for module in graph.modules()
            if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes if node.op == "call_function"]


def test_the_graph_holds_the_casts_and_no_gemm_op():
    """Dynamo's graph makes the GEMMs with torch._scaled_mm (three per Linear: fprop in the
    autograd.Function's forward body, dgrad and wgrad in its backward body) and calls none of
    minifloat's GEMM ops."""
    graphs = []
    torch.manual_seed(0)
    compiled = torch.compile(Block(), backend=_recording_backend(graphs), fullgraph=True)
    _results(compiled, mf.Float8CurrentScaling())
    (graph,) = graphs
    names = _op_names(graph)
    assert not any("minifloat.gemms" in name for name in names), graph.code
    assert sum("_scaled_mm" in name for name in names) == 6, graph.code


class Projections(torch.nn.Module):
    """Three projections of one normed input, as transformers' Llama and Mistral attention
    run q_proj, k_proj and v_proj (and gate_proj, up_proj in their MLPs)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(64)
        self.q = torch.nn.Linear(64, 96, bias=False)
        self.k = torch.nn.Linear(64, 32, bias=False)
        self.v = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1)


def test_sibling_projections_cast_their_shared_input_once(monkeypatch):
    """On this path the graph holds each cast as an op of its inputs, so the compiler's common
    subexpression elimination merges the three casts of q/k/v's one input: seven casts a step
    (the input once, three weights, three gradients) where the GEMM ops path makes nine (each
    op casts its input inside), and the results stay eager's bit for bit."""
    casts = []
    cast_call = lean_fp8.Cast.__call__

    def counted(self, x, **kwargs):
        casts.append(tuple(x.shape))
        return cast_call(self, x, **kwargs)

    monkeypatch.setattr(lean_fp8.Cast, "__call__", counted)
    torch.manual_seed(0)
    model = mf.convert_model(Projections())
    recipe = mf.Float8CurrentScaling()
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(2))
    dy = torch.randn(2, 40, 160, generator=torch.Generator().manual_seed(3))
    eager = _step(model, recipe, x, dy, seed=0)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _step(compiled, recipe, x, dy, seed=0)  # traces
    casts.clear()
    results = _step(compiled, recipe, x, dy, seed=0)
    assert casts.count((80, 64)) == 1, casts  # the shared input [80 rows, 64]
    assert len(casts) == 7, casts
    for index, (a, b) in enumerate(zip([results[0], results[1], *results[2]],
                                       [eager[0], eager[1], *eager[2]], strict=True)):
        assert torch.equal(a, b), f"tensor {index}"


def test_delayed_scaling_keeps_the_gemm_ops():
    graphs = []
    torch.manual_seed(0)
    compiled = torch.compile(Block(), backend=_recording_backend(graphs), fullgraph=True)
    _results(compiled, mf.DelayedScaling())
    (graph,) = graphs
    assert sum("minifloat.gemms_forward" in name for name in _op_names(graph)) == 2, graph.code


def test_inductor_runs_the_graph_casts_close_to_eager():
    torch.manual_seed(0)
    model = Block()
    recipe = mf.Float8CurrentScaling()
    eager = _results(model, recipe)
    compiled = _results(torch.compile(model, backend="inductor", fullgraph=True), recipe)
    for index, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert torch.allclose(a, b, rtol=0.05, atol=0.05), f"tensor {index}"


def test_the_partitioner_keeps_the_copies_or_with_the_memory_options_none():
    """By default backward reads forward's FP8 copies (the inputs' and the weights', outputs
    of the current_cast op, which the partitioner cannot recompute); with the memory options
    nothing one byte wide is kept, and the inputs are recomputed rather than kept in high precision
    (test_compile_memory.py asks the same of gemm_op's ops)."""
    from test_compile import _build
    from test_compile_memory import _kept_for_backward, _lowest_memory

    recipe = mf.Float8CurrentScaling()
    default = _kept_for_backward(_build("convert_model"), recipe)
    lowest = _kept_for_backward(_lowest_memory(_build("convert_model")), recipe)
    assert len([t for t in default if t.element_size() == 1]) == 4  # two inputs', two weights'
    assert [t for t in lowest if t.element_size() == 1] == []
    assert (sum(t.numel() * t.element_size() for t in lowest)
            < sum(t.numel() * t.element_size() for t in default))


def test_switching_the_path_retraces_the_compiled_function(monkeypatch):
    """graph_casts.switched: a function compiled with one path is traced again for the other
    (dynamo guards on the switch), so one process can compare both (model_step's -graphcasts
    rows)."""
    monkeypatch.setattr(graph_casts, "ENABLED", False)
    graphs = []
    torch.manual_seed(0)
    compiled = torch.compile(Block(), backend=_recording_backend(graphs), fullgraph=True)
    recipe = mf.Float8CurrentScaling()
    _results(compiled, recipe)
    with graph_casts.switched(True):
        _results(compiled, recipe)
    _results(compiled, recipe)  # back to the ops: the first graph serves again
    assert not graph_casts.ENABLED and len(graphs) == 2
    ops, casts = (_op_names(graph) for graph in graphs)
    assert any("minifloat.gemms_forward" in name for name in ops)
    assert not any("minifloat.gemms_forward" in name for name in casts)
    assert any("_scaled_mm" in name for name in casts)


def test_the_compile_mode_is_read_from_the_backend():
    """compiled_without_cuda_graphs: True under inductor without CUDA graphs (the default mode,
    max-autotune-no-cudagraphs), False under reduce-overhead, another backend, or eagerly. If a
    torch release moves what it reads, this fails rather than the default silently changing."""
    seen = []

    def probe(x):
        seen.append(graph_casts.compiled_without_cuda_graphs())
        return x + 1

    for options in ({}, {"mode": "max-autotune-no-cudagraphs"}, {"mode": "reduce-overhead"},
                    {"backend": "aot_eager"}):
        torch._dynamo.reset()
        torch.compile(probe, fullgraph=True, **options)(torch.ones(2))
    assert seen == [True, True, False, False]
    assert graph_casts.compiled_without_cuda_graphs() is False  # not compiling


@pytest.mark.parametrize("mode, graph_path", [(None, True), ("reduce-overhead", False)],
                         ids=["default-mode", "reduce-overhead"])
def test_by_default_the_path_follows_the_compile_mode(monkeypatch, mode, graph_path):
    """ENABLED None (no MINIFLOAT_GRAPH_CASTS): inductor without CUDA graphs traces the graph
    casts, reduce-overhead gemm_op's ops. The backend is torch.compile's inductor wrapper for
    that mode, made to record dynamo's graph instead of compiling it."""
    monkeypatch.setattr(graph_casts, "ENABLED", None)
    graphs = []

    class RecordingInductor(torch._TorchCompileInductorWrapper):
        def __call__(self, graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

    torch.manual_seed(0)
    backend = RecordingInductor(mode, None, False)
    _results(torch.compile(Block(), backend=backend, fullgraph=True), mf.Float8CurrentScaling())
    (graph,) = graphs
    names = _op_names(graph)
    assert any("_scaled_mm" in name for name in names) == graph_path, graph.code
    assert any("minifloat.gemms_forward" in name for name in names) != graph_path, graph.code


@pytest.mark.parametrize("value, expected", [("", None), ("1", True), ("0", False)])
def test_the_environment_switch(monkeypatch, value, expected):
    monkeypatch.setenv("MINIFLOAT_GRAPH_CASTS", value)
    assert graph_casts._from_environment() is expected


def test_an_unknown_environment_value_names_the_choices(monkeypatch):
    monkeypatch.setenv("MINIFLOAT_GRAPH_CASTS", "yes")
    with pytest.raises(ValueError, match="set it to 1 .* 0 .* or leave it unset"):
        graph_casts._from_environment()
