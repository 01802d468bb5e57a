"""FusedExperts on device-side group offsets (modules/grouped_offsets.py) on the CPU.

Checked against independent computations: the layout against the routing it lays out, the
saved bytes against numerics' per-tensor current-scaling cast of each expert's rows alone, the
outputs and gradients against the general path (one LinearGemms per expert GEMM, host-side
splits). Then what a compiled model needs: a transformers Mixtral traces with fullgraph=True,
computes bitwise what the eager device path computes, and a new routing does not recompile.
Recipes and shapes the path does not serve keep the host-counts path (delayed scaling:
test_grouped_offsets_delayed.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import minifloat as mf
from minifloat.modules import fused_experts as fused_experts_module
from minifloat.modules.grouped_offsets import (
    GROUP_ROWS,
    GroupedOffsetsFP8,
    padded_rows,
    routing_layout,
)
from minifloat.modules.grouped_offsets_blocks import GroupedOffsetsBlocks
from minifloat.numerics.per_tensor import quantize_current_scaling
from modules.test_any_token_count import fused_experts
from modules.test_lean_grouped_fp8 import routed, run
from training._reference import rel_err

HYBRID = mf.Float8CurrentScaling()
E4M3 = mf.Float8CurrentScaling(fp8_format=mf.Format.E4M3)
# NVFP4 without stochastic rounding: its draws differ between a compiled and an eager run
# (test_grouped_offsets_nvfp4.py checks the default recipe)
SR_OFF = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)


def counting_calls(monkeypatch, function) -> list[int]:
    """The row counts of the inputs of every call of `function`'s forward."""
    calls = []
    original = function.forward

    def counting(ctx, x, *args):
        calls.append(x.shape[0])
        return original(ctx, x, *args)

    monkeypatch.setattr(function, "forward", staticmethod(counting))
    return calls


@pytest.fixture
def offsets_calls(monkeypatch):
    """The per-tensor FP8 device-offsets GEMM calls."""
    return counting_calls(monkeypatch, GroupedOffsetsFP8)


@pytest.fixture
def blocks_calls(monkeypatch):
    """The block formats' device-offsets GEMM calls."""
    return counting_calls(monkeypatch, GroupedOffsetsBlocks)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_layout_puts_each_pair_in_its_experts_padded_rows(index_dtype):
    g = torch.Generator().manual_seed(0)
    tokens, experts, top_k = 50, 5, 2
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    index[index == 3] = 4  # expert 3 gets nothing
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % 3, index[:, 1])
    layout = routing_layout(index.to(index_dtype), experts)
    rows = padded_rows(tokens * top_k, experts)
    source = layout.pair_of_row // top_k  # the token each row copies (tokens: padding)
    assert source.shape == (rows,) and rows % GROUP_ROWS == 0
    ends = layout.ends.tolist()
    assert ends[-1] == rows and all(end % GROUP_ROWS == 0 for end in ends)
    counts = torch.bincount(index.reshape(-1), minlength=experts).tolist()
    starts = [0, *ends[:-1]]
    for e in range(experts):  # each expert's tokens, in token order, then zero rows (tokens)
        mine = [t for t in range(tokens) for k in range(top_k) if index[t, k] == e]
        block = source[starts[e]:ends[e]].tolist()
        assert block[:counts[e]] == mine
        assert all(row == tokens for row in block[counts[e]:])
        assert ends[e] - starts[e] == (-(-counts[e] // GROUP_ROWS) * GROUP_ROWS
                                       if e < experts - 1 else rows - starts[e])
    # pair p (token p // top_k, slot p % top_k) sits in one row, which names it back; the rows
    # that hold no pair are padding
    pairs = torch.arange(tokens * top_k)
    assert torch.equal(source[layout.pair_row], pairs // top_k)
    assert torch.equal(layout.pair_of_row[layout.pair_row], pairs)
    padding = torch.ones(rows, dtype=torch.bool).index_fill_(0, layout.pair_row, False)
    assert (layout.pair_of_row[padding] == tokens * top_k).all()
    assert (source[padding] == tokens).all()


def assert_paths_agree(experts, inputs: tuple, recipe: mf.Recipe, calls: list[int]) -> list:
    """Runs the experts on the device path, then on the general path (per-expert quantizers,
    host splits); asserts that both grouped GEMMs (80 routed pairs over 4 experts) took the
    device path whose forward `calls` counts, and that outputs and gradients agree to summation
    order. Returns the device path's FP8 tensors saved for backward."""
    with fused_experts_module.offsets_mode("always"):
        y, dx, grads, saved = run(experts, *inputs, recipe=recipe)
    assert calls == [padded_rows(80, 4)] * 2, "both grouped GEMMs on device offsets"
    with fused_experts_module.offsets_mode("never"):
        y_g, dx_g, grads_g, _ = run(experts, *inputs, recipe=recipe)
    assert len(calls) == 2
    for got, want in ((y, y_g), (dx, dx_g), *zip(grads, grads_g, strict=True)):
        assert rel_err(got, want) < 1e-6
    return saved


@pytest.mark.parametrize("recipe", [HYBRID, E4M3], ids=["hybrid", "e4m3"])
@pytest.mark.parametrize("empty_expert", [None, 2])
def test_device_offsets_equal_the_general_path(offsets_calls, recipe, empty_expert):
    torch.manual_seed(0)
    experts = fused_experts(4, 32, 48)
    inputs = routed(empty_expert=empty_expert)
    saved = assert_paths_agree(experts, inputs, recipe, offsets_calls)
    # saved for backward: gate_up's x^T, its W^T copy, down's input^T, its W^T copy
    assert [t.shape for t in saved] == [(32, 640), (4, 32, 96), (48, 640), (4, 48, 32)]


@pytest.mark.parametrize("weight_rows", [32, GROUP_ROWS])
def test_saved_bytes_are_each_experts_own_current_scaling_cast(weight_rows):
    """The input's columnwise bytes of each expert's rows equal numerics' cast of those rows
    alone (transposed), and the weight copy each expert's own cast: an independent computation
    with no padding, no grouping and no other expert's rows. (Weights of N in whole 128s are
    cast as one matrix's rows, their transposed copy one [K, E * N] matrix.)"""
    torch.manual_seed(2)
    weight = torch.randn(3, weight_rows, 64)
    counts = [GROUP_ROWS, 0, 2 * GROUP_ROWS]
    x = torch.zeros(sum(counts), 64)
    real = {0: 100, 2: 130}  # real rows per expert, the rest zero padding
    x[:100] = torch.randn(100, 64) * 5
    x[GROUP_ROWS:GROUP_ROWS + 130] = torch.randn(130, 64) / 7
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    packed = []
    x.requires_grad_(True)
    casts = fused_experts_module.OffsetsCasts(torch.float8_e4m3fn, torch.float8_e4m3fn,
                                              torch.float8_e5m2, 0.0, False)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        GroupedOffsetsFP8.apply(x, weight, ends, casts, True, True, False, False)
    x_t, x_scale_inv, w_t, w_scale_inv, _ = packed
    starts = {0: 0, 2: GROUP_ROWS}
    for e, rows in real.items():
        data, scale_inv = quantize_current_scaling(x[starts[e]:starts[e] + rows].detach(),
                                                   torch.float8_e4m3fn)
        got = x_t[:, starts[e]:starts[e] + rows].t()
        assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(x_scale_inv[e], scale_inv)
    for e in range(3):
        data, scale_inv = quantize_current_scaling(weight[e], torch.float8_e4m3fn)
        assert torch.equal(w_t[e].t().view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(w_scale_inv[e], scale_inv)


def test_nan_in_one_experts_rows_stays_nan():
    torch.manual_seed(3)
    experts = fused_experts(3, 32, 32)
    x, index, weights, _ = routed(tokens=24, hidden=32, experts=3)
    x[0, 0] = float("nan")
    with torch.no_grad(), mf.autocast(recipe=HYBRID), fused_experts_module.offsets_mode(
            "always"):
        y = experts(x, index, weights)
    assert torch.isnan(y[0]).any()
    # a token routed to neither of token 0's experts keeps finite values
    others = [t for t in range(24) if not set(index[t].tolist()) & set(index[0].tolist())]
    if others:
        assert torch.isfinite(y[others]).all()


@pytest.mark.parametrize("recipe", [mf.DelayedScaling(),
                                    mf.Float8BlockScaling(power_2_scale=False)],
                         ids=["delayed", "block-fp32-scales"])
def test_other_recipes_keep_the_host_counts_path(offsets_calls, blocks_calls, recipe):
    torch.manual_seed(0)
    experts = fused_experts(4, 32, 64)
    with fused_experts_module.offsets_mode("always"):
        run(experts, *routed(tokens=64), recipe=recipe)
    assert offsets_calls == [] and blocks_calls == []


@pytest.mark.parametrize("recipe", [mf.MXFP8BlockScaling(), mf.Float8BlockScaling()],
                         ids=["mxfp8", "block"])
@pytest.mark.parametrize("empty_expert", [None, 2])
def test_block_formats_on_device_offsets_equal_the_general_path(blocks_calls, recipe,
                                                                 empty_expert):
    """MXFP8 and FP8 block scaling (grouped_offsets_blocks.py): the whole padded buffer
    quantized at once gives each expert the blocks of its own rows, so outputs and gradients
    equal the general path's (per-expert quantizers, host splits) to summation order."""
    torch.manual_seed(0)
    experts = fused_experts(4, 128, 64)  # 2-D weight tiles: N (2F, D) in whole 128s
    inputs = routed(tokens=40, hidden=128, empty_expert=empty_expert)
    assert_paths_agree(experts, inputs, recipe, blocks_calls)


def test_block_tiles_that_would_cross_experts_keep_the_host_counts_path(blocks_calls):
    """2-D 128x128 weight tiles over [E * N, K] cut at experts only when N is a multiple of
    128: gate_up's N = 96 here."""
    torch.manual_seed(0)
    experts = fused_experts(4, 64, 48)
    with fused_experts_module.offsets_mode("always"):
        run(experts, *routed(tokens=40, hidden=64), recipe=mf.Float8BlockScaling())
    assert blocks_calls == []


def test_offsets_mode_refuses_an_unknown_mode():
    with (pytest.raises(ValueError, match="compiled, always or never"),
          fused_experts_module.offsets_mode("sometimes")):
        pass


@pytest.mark.parametrize("recipe,hidden", [(HYBRID, 64), (mf.MXFP8BlockScaling(), 64),
                                           (mf.Float8BlockScaling(), 128),
                                           (mf.DelayedScaling(amax_history_len=4), 128),
                                           (SR_OFF, 64)],
                         ids=["fp8-current", "mxfp8", "block", "delayed", "nvfp4"])
def test_compiled_mixtral_traces_the_experts_in_one_graph_and_does_not_recompile(recipe, hidden):
    """fullgraph=True (a host read of the token counts would break it), the same loss and
    gradients as the eager device path bitwise, and a second routing reuses the graph.
    (Block FP8's 2-D weight tiles, and delayed scaling's weight casts, need the experts'
    N = hidden in whole 128s; delayed scaling's experts record their amaxes.)"""
    model, eager, got, want, graphs = compiled_and_eager_mixtral(recipe, hidden)
    assert torch.equal(got["loss"], want["loss"])
    for name, grad in got["grads"].items():
        assert (grad is None) == (want["grads"][name] is None), name
        if grad is not None:
            assert torch.equal(grad, want["grads"][name]), name
    if isinstance(recipe, mf.DelayedScaling):
        forward, backward = model.model.layers[0].mlp.experts._recipe_states[recipe]
        assert forward.amax_history.abs().sum() > 0 and backward.amax_history[0].gt(0).any()
    assert graphs == [1, 1]


def compiled_and_eager_mixtral(recipe: mf.Recipe, hidden: int, seq: int = 13):
    """A converted one-layer transformers Mixtral (4 experts, top-2) and its eager copy, one
    training step of each under `recipe` (the eager one on the device path): (model, eager,
    the compiled step's and the eager step's {"loss", "grads" by parameter name}, the compiled
    model's graph count after that step and after a step on another routing)."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from models.test_transformers import SMALL, not_head

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**SMALL, "hidden_size": hidden, "num_hidden_layers": 1}, num_local_experts=4,
        num_experts_per_tok=2))
    mf.convert_model(model, filter_fn=not_head)
    eager = copy.deepcopy(model)

    def step(module, tokens):
        with mf.autocast(recipe=recipe):
            loss = module(tokens, labels=tokens).loss
        loss.backward()
        grads = {name: None if p.grad is None else p.grad.clone()
                 for name, p in getattr(module, "_orig_mod", module).named_parameters()}
        module.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "grads": grads}

    first, second = (torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(s))
                     for s in (1, 5))
    with fused_experts_module.offsets_mode("always"):
        want = step(eager, first)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = step(compiled, first)
    graphs = [counters["stats"]["unique_graphs"]]
    step(compiled, second)
    return model, eager, got, want, graphs + [counters["stats"]["unique_graphs"]]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_saturating_encode_gives_the_reference_bytes(dtype):
    """Values over every binade (subnormals, ties, past the maximum), signed zeros, inf and
    NaN: the two-op encoding equals numerics' cast_to_fp8 byte for byte."""
    from minifloat.modules.grouped_offsets import saturating_encode
    from minifloat.numerics.formats import cast_to_fp8

    g = torch.Generator().manual_seed(0)
    exponents = torch.randint(-26, 20, (20000,), generator=g).float()
    values = torch.randn(20000, generator=g) * torch.exp2(exponents)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    grid = torch.unique(grid[torch.isfinite(grid)])  # every value of the format, sorted
    ties = (grid[1:] + grid[:-1]) / 2  # halfway between neighbours: round to even
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30])
    for x in (values, grid, ties, special):
        got, want = saturating_encode(x, dtype), cast_to_fp8(x, dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("recipe,copy_bytes", [(HYBRID, 1), (mf.MXFP8BlockScaling(), 1),
                                               (SR_OFF, 0.5)], ids=["hybrid", "mxfp8", "nvfp4"])
def test_memory_options_keep_the_originals_and_compute_the_same(recipe, copy_bytes):
    """rebuild_weight_copies_in_backward and save_original_inputs on the device path: backward
    casts the weights (and x) again instead of keeping forward's copies: the weights' copies
    are not kept (fewer bytes), with both options no FP8 buffer is, and the results are the
    same bit for bit."""
    torch.manual_seed(0)
    experts = fused_experts(4, 32, 64)
    inputs = routed()
    weights = {p.data_ptr() for p in experts.parameters()}

    def kept_and_results():
        kept = []
        x = inputs[0].clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t,
                                                      lambda t: t), mf.autocast(
                recipe=recipe), fused_experts_module.offsets_mode("always"):
            y = experts(x, inputs[1], inputs[2])
        y.backward(inputs[3])
        results = [y.detach(), x.grad] + [p.grad.clone() for p in experts.parameters()]
        experts.zero_grad(set_to_none=True)
        copies = sum(t.numel() * t.element_size() for t in kept if t.data_ptr() not in weights)
        return copies, kept, results

    copies_default, _, want = kept_and_results()
    mf.rebuild_weight_copies_in_backward(experts)
    copies_rebuild, kept, got = kept_and_results()
    assert copies_default - copies_rebuild >= copy_bytes * sum(  # the copy's bytes an element
        p.numel() for p in experts.parameters())
    assert weights <= {t.data_ptr() for t in kept}  # the weights themselves instead
    mf.save_original_inputs(experts)
    _, kept, got_both = kept_and_results()
    assert not any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in kept)
    for results in (got, got_both):
        for a, b in zip(results, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [48, GROUP_ROWS])
def test_weights_cast_op_lays_out_what_its_fake_says(n):
    """The stacked weights' cast op: the fake implementation gives the real copies' shapes and
    strides (inductor asserts them), whichever layout the shapes choose, and the bytes are each
    expert's own cast in both copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from minifloat.modules import grouped_offsets

    weight = torch.randn(3, n, 32, generator=torch.Generator().manual_seed(4))
    real = grouped_offsets.stacked_weights_cast(weight, torch.float8_e4m3fn, 0.0, False, True,
                                                True)
    with FakeTensorMode() as mode:
        fake = grouped_offsets.stacked_weights_cast(mode.from_tensor(weight),
                                                    torch.float8_e4m3fn, 0.0, False, True, True)
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    data, data_t, scale_inv = real
    for e in range(3):
        want, want_scale_inv = quantize_current_scaling(weight[e], torch.float8_e4m3fn)
        assert torch.equal(data[e].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(data_t[e].t().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(scale_inv[e], want_scale_inv)


def test_one_grouped_gemm_under_inductor_equals_eager_with_the_strided_weight_copy():
    """Inductor (which asserts the ops' output strides against their fake implementations)
    on one device-offsets GEMM whose weight N is in whole 128s: the weights' transposed copy is
    one [K, E * N] matrix read through strides in dgrad. Outputs and gradients bitwise eager's."""
    torch.manual_seed(0)
    experts, hidden, tokens = 4, 64, 50
    index = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)])
    layout = routing_layout(index, experts)
    x = torch.randn(layout.pair_of_row.shape[0], hidden)
    x[layout.pair_of_row == 2 * tokens] = 0  # padding rows hold zeros
    weight = torch.randn(experts, GROUP_ROWS, hidden)
    casts = fused_experts_module.OffsetsCasts(torch.float8_e4m3fn, torch.float8_e4m3fn,
                                              torch.float8_e5m2, 0.0, False)

    def gemm(x, weight):
        return GroupedOffsetsFP8.apply(x, weight, layout.ends, casts, True, True, False, False)

    results = []
    for fn in (gemm, torch.compile(gemm, fullgraph=True)):
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        y = fn(xi, wi)
        y.backward(torch.ones_like(y))
        results.append((y, xi.grad, wi.grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
