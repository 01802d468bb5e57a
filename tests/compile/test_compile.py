"""torch.compile(fullgraph=True) of minifloat modules and convert_model'd models, every recipe.

The compiled path runs the module's GEMMs through the custom ops minifloat::gemms_forward /
gemms_backward (modules/gemm_op.py); the eager path runs the autograd function LinearGemms. Both
call the same forward and backward functions, so with the `aot_eager` backend (AOTAutograd
tracing, no inductor code generation around the ops) outputs and gradients must be equal bit for
bit; one inductor run checks that inductor's own code for the surrounding ops (norms,
activations) keeps the result within a bf16-level tolerance. Every case also asserts what dynamo
reports: no graph break, and no recompile when blocks of equal configuration are compiled one by
one (the guard is an int standing for the recipe, never a module name or quantizer).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import minifloat as mf

RECIPES = {
    "delayed": mf.DelayedScaling(amax_history_len=4),
    "current": mf.Float8CurrentScaling(),
    "block": mf.Float8BlockScaling(),
    "mxfp8": mf.MXFP8BlockScaling(),
    "nvfp4": mf.NVFP4BlockScaling(),
    "hybrid": mf.HybridRecipe(fprop=mf.MXFP8BlockScaling(), dgrad=mf.NVFP4BlockScaling(),
                              wgrad=mf.NVFP4BlockScaling()),
    "custom": mf.CustomRecipe(mf.factories.nvfp4_like),  # quantizers chosen by role
}
HIDDEN, FFN, ROWS = 128, 256, 128  # block FP8 needs multiples of 128

# Code reached while tracing must not ask a fake tensor for its address (CUDA raises; the CPU
# only warns, so the warning is made an error here to catch it on the CPU too).
pytestmark = pytest.mark.filterwarnings("error:Accessing the data pointer of FakeTensor")


class PlainMLP(nn.Module):
    """What a user brings: torch.nn layers only (converted by convert_model)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Grouped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = mf.GroupedLinear(2, HIDDEN, HIDDEN, name="experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, [ROWS // 2, ROWS // 2])


MODULES = {
    "linear": lambda: mf.Linear(HIDDEN, FFN, name="fc"),
    "layernorm_linear": lambda: mf.LayerNormLinear(HIDDEN, FFN, normalization="RMSNorm",
                                                   name="qkv"),
    "layernorm_mlp": lambda: mf.LayerNormMLP(HIDDEN, FFN, name="mlp"),
    "grouped_linear": Grouped,
    "convert_model": lambda: mf.convert_model(PlainMLP()),
}


def _build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODULES[kind]()


def _step(model: nn.Module, recipe: mf.Recipe, x: torch.Tensor, dy: torch.Tensor, seed: int):
    """Forward under autocast and backward: (y, dx, parameter gradients)."""
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # NVFP4 stochastic rounding draws from torch's generator
    with mf.autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _data(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _dy_like(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.randn(model(x).shape, generator=torch.Generator().manual_seed(99))


def _assert_trains_like_eager(eager: nn.Module, compiled, recipe: mf.Recipe, label: str) -> None:
    """Two steps on the same batches: output, input gradient and parameter gradients bitwise
    equal to the eager model's."""
    dy = _dy_like(eager, _data(0))
    for step in range(2):
        x = _data(step + 1)
        want = _step(eager, recipe, x, dy, seed=step)
        got = _step(compiled, recipe, x, dy, seed=step)
        for index, (a, b) in enumerate(zip([got[0], got[1], *got[2]],
                                           [want[0], want[1], *want[2]], strict=True)):
            _assert_bitwise(a, b, f"{label} step {step} result {index}")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    bits = _BITS[a.element_size()]
    assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), what


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
def test_fullgraph_no_breaks_and_bitwise_equal_to_eager(kind, recipe_name):
    recipe = RECIPES[recipe_name]
    eager, compiled_model = _build(kind), _build(kind)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x0 = _data(0)
    dy = _dy_like(eager, x0)
    with mf.autocast(recipe=recipe):  # on a third copy: explain runs it (delayed state)
        explanation = torch._dynamo.explain(_build(kind))(x0.clone().requires_grad_(True))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    for step in range(2):  # delayed scaling: the second step uses updated scales
        x = _data(step + 1)
        want = _step(eager, recipe, x, dy, seed=step)
        got = _step(compiled, recipe, x, dy, seed=step)
        for label, a, b in (("y", got[0], want[0]), ("dx", got[1], want[1])):
            _assert_bitwise(a, b, f"{kind} {recipe_name} step {step} {label}")
        for index, (a, b) in enumerate(zip(got[2], want[2], strict=True)):
            _assert_bitwise(a, b, f"{kind} {recipe_name} step {step} grad {index}")
    if recipe_name == "delayed":
        mf.update_delayed_backward_scales()
        for mine, theirs in zip(_delayed_states(compiled_model, recipe),
                                _delayed_states(eager, recipe), strict=True):
            _assert_bitwise(mine.amax_history, theirs.amax_history, "amax history")
            _assert_bitwise(mine.scale, theirs.scale, "scale")
            assert mine.amax_history.abs().sum() > 0


def _delayed_states(model: nn.Module, recipe: mf.Recipe):
    for module in model.modules():
        if isinstance(module, mf.Linear | mf.LayerNormLinear | mf.LayerNormMLP
                      | mf.GroupedLinear):
            yield from module.recipe_states(recipe)


def test_blocks_compiled_one_by_one_share_one_graph():
    """Eight Linear blocks compiled separately (as FSDP2 users compile per block): the guards
    hold for every block, so dynamo compiles one graph and never recompiles."""
    torch._dynamo.reset()
    recipe = RECIPES["current"]
    blocks = [mf.Linear(HIDDEN, HIDDEN, name=f"layers.{i}.fc") for i in range(8)]
    compiled = [torch.compile(b, backend="aot_eager", fullgraph=True) for b in blocks]
    torch._dynamo.utils.counters.clear()
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    with mf.autocast(recipe=recipe):
        h = x
        for block in compiled:
            h = block(h)
    h.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_recipe_change_recompiles_and_follows_the_recipe():
    """Switching recipes is seen by the compiled module (it guards on the recipe's token)."""
    model = _build("linear")
    reference = _build("linear")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _data(3)
    for name in ("current", "mxfp8"):
        with mf.autocast(recipe=RECIPES[name]):
            got = compiled(x)
            want = reference(x)
        assert torch.equal(got, want), name
    assert torch.equal(compiled(x), reference(x))  # outside autocast: plain F.linear


@pytest.mark.parametrize("keep_copies", [True, False])
def test_inductor_matches_eager_within_bf16_tolerance(keep_copies):
    """The default backend: inductor generates the norm and activation code around the ops
    (keeping no copies: also the recomputed norm and activation and the cast in backward,
    tests/compile/test_compile_memory.py)."""
    recipe = RECIPES["current"]
    eager, model = _build("convert_model"), _build("convert_model")
    if not keep_copies:
        mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(model))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = _data(5)
    dy = _dy_like(eager, x)
    want, got = _step(eager, recipe, x, dy, 0), _step(compiled, recipe, x, dy, 0)
    for a, b in ((got[0], want[0]), (got[1], want[1]), *zip(got[2], want[2], strict=True)):
        error = (a - b).norm() / b.norm()
        assert error < 2e-2, float(error)


def test_is_first_microbatch_is_refused_under_compile():
    model = mf.Linear(HIDDEN, HIDDEN)
    compiled = torch.compile(lambda x: model(x, is_first_microbatch=True), backend="aot_eager",
                             fullgraph=True)
    with mf.autocast(recipe=RECIPES["current"]), pytest.raises(Exception,
                                                               match="is_first_microbatch"):
        compiled(torch.randn(ROWS, HIDDEN))


def test_autocast_inside_compiled_code_is_refused():
    model = mf.Linear(HIDDEN, HIDDEN)

    def step(x):
        with mf.autocast(recipe=RECIPES["current"]):
            return model(x)

    with pytest.raises(Exception, match="outside the compiled"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(torch.randn(ROWS, HIDDEN))


@pytest.mark.parametrize("original_inputs", [False, True])
@pytest.mark.parametrize("kind", ["convert_model", "grouped_linear", "layernorm_mlp"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_compiled_ops_rebuild_weight_copies_in_backward(recipe_name, kind, original_inputs,
                                                       monkeypatch):
    """With rebuild_weight_copy_in_backward (FSDP2), the compiled forward keeps no weight copy
    and the backward op quantizes the weights again: bitwise equal to eager keeping its copies.
    Delayed scaling too: the forward op hands forward's scales to backward (the recipe state's
    are updated in between). With save_original_inputs as well, no input copy either (the
    backward formula casts the input again: tests/compile/test_compile_memory.py)."""
    from minifloat.distributed import rebuild_weight_copies_in_backward
    from minifloat.modules import gemm_op

    torch._dynamo.reset()  # the cases' models share forward code: keep off the recompile limit

    calls = []
    original = gemm_op.rebuild_weight_copy
    monkeypatch.setattr(gemm_op, "rebuild_weight_copy",
                        lambda *args: calls.append(1) or original(*args))
    recipe = RECIPES[recipe_name]
    eager = _build(kind)
    compiled_model = rebuild_weight_copies_in_backward(
        mf.save_original_inputs(_build(kind), enabled=original_inputs))
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    _assert_trains_like_eager(eager, compiled, recipe, recipe_name)
    # two GEMMs (or experts) a step, two steps
    assert len(calls) == 4


def test_op_outputs_sharing_one_storage_are_unaliased():
    """Two outputs written into one buffer (as a multi-tensor kernel writes several experts'
    copies) have no `_base`; torch's custom-op check still sees them alias (it failed a
    compiled Mixtral step on an H200): the second is cloned, values kept."""
    from minifloat.modules.gemm_op import _unaliased

    buffer = torch.arange(8.0)
    first = torch.empty(0).set_(buffer.untyped_storage(), 0, (4,))
    second = torch.empty(0).set_(buffer.untyped_storage(), 4, (4,))
    assert first._base is None and second._base is None
    kept = _unaliased([first, second], [torch.ones(2)])
    assert kept[0] is first and kept[1] is not second and torch.equal(kept[1], second)
    assert kept[1].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    passthrough = _unaliased([buffer[:2]], [buffer])  # a view of an input
    assert passthrough[0].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_fused_experts_in_a_compiled_model_never_recompile_for_new_routing():
    """A MoE's experts read their token counts on the host; traced, every step's new counts
    became guards and recompiled the experts' frame until the recompile limit. They run eagerly
    (one graph break at the call) with the rest of the model compiled: no recompile across
    routings, and the results of eager mode."""
    from modules.test_any_token_count import fused_experts

    torch.manual_seed(0)
    experts = fused_experts(4, 32, 32)
    router = torch.nn.Linear(32, 4)

    def layer(x):
        logits = router(x)
        weights, index = torch.topk(logits.softmax(-1), 2)
        return experts(torch.relu(x), index, weights) + x

    compiled = torch.compile(layer, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(4):
            x = torch.randn(40, 32, generator=torch.Generator().manual_seed(step))
            with mf.autocast(recipe=mf.Float8CurrentScaling()):
                got = compiled(x)
                want = layer(x)
            assert torch.equal(got, want)
