"""NVFP4 experts on device-side group offsets (modules/grouped_offsets_nvfp4.py) on the CPU.

Checked against independent computations: each group's block values and global decode scale
against numerics' quantize_nvfp4 of that expert's rows alone (rowwise, columnwise with the RHT,
the weights' 2-D tiles and 1-D columns); outputs and gradients against the general path (one
LinearGemms per expert GEMM, host-side splits); with stochastic rounding on, errors against the
high-precision experts of the general path's size. Then the default recipe in a compiled
Mixtral: one graph with fullgraph=True, no recompile.
"""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.modules import fused_experts as fused_experts_module
from minifloat.modules.grouped_offsets import routing_layout
from minifloat.modules.grouped_offsets_nvfp4 import (
    GroupedOffsetsNVFP4,
    NVFP4Cast,
    columns_values,
    offsets_nvfp4,
    rows_values,
    weight_copy,
    weight_values,
)
from minifloat.numerics import nvfp4 as nvfp4_numerics
from minifloat.quantizers import NVFP4Quantizer
from modules.test_any_token_count import fused_experts
from modules.test_grouped_offsets import (
    assert_paths_agree,
    compiled_and_eager_mixtral,
    counting_calls,
)
from modules.test_lean_grouped_fp8 import routed, run
from training._reference import rel_err

SR_OFF = mf.NVFP4BlockScaling(disable_stochastic_rounding=True)


@pytest.fixture
def nvfp4_calls(monkeypatch):
    return counting_calls(monkeypatch, GroupedOffsetsNVFP4)


def reference(x2d: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics' NVFP4 quantization of x2d as one tensor: (block values, S_dec) of its one
    requested copy (columnwise: x^T's layout)."""
    out = nvfp4_numerics.quantize_nvfp4(x2d, **options)
    copy_ = "rowwise" if options.get("rowwise", True) else "columnwise"
    values = nvfp4_numerics.dequantize_nvfp4_blocks(out[f"{copy_}_data"], out[f"{copy_}_scale"])
    amax = out["amax_rowwise" if copy_ == "rowwise" else "amax_columnwise"]
    return values, nvfp4_numerics.global_decode_scale(amax).reshape(())


def layout_of(counts: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A routing whose experts get `counts` pairs: the layout's ends and each group's real rows
    (start, end) in the padded buffer."""
    index = torch.cat([torch.full((count,), expert) for expert, count in enumerate(counts)])
    index = torch.stack([index, index], dim=1)[:, :1]  # top-1: one pair per token
    layout = routing_layout(index, len(counts))
    starts = [0, *layout.ends[:-1].tolist()]
    return layout.ends, [(start, start + count) for start, count in zip(starts, counts,
                                                                        strict=True)]


@pytest.mark.parametrize("with_rht", [False, True])
def test_each_groups_values_are_that_experts_own_quantization(with_rht):
    """Rowwise and columnwise (RHT or not) values of a padded buffer whose groups hold 40, 0,
    130 and 16 real rows (zeros elsewhere): each group's equal numerics' quantization of its
    real rows alone (padded to 16 rows, as the general path pads), S_dec too (an empty group's
    S_dec is 1: amax 0)."""
    ends, spans = layout_of([40, 0, 130, 16])
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(int(ends[-1]), 64)
    for expert, (start, end) in enumerate(spans):
        x[start:end] = torch.randn(end - start, 64, generator=g) * (expert + 1) ** 2
    cast = NVFP4Cast(with_rht=with_rht)
    rows, rows_s_dec = rows_values(x, ends, cast)
    cols, cols_s_dec = columns_values(x, ends, cast)
    for expert, (start, end) in enumerate(spans):
        stop = start + -(-(end - start) // 16) * 16
        if stop == start:
            assert rows_s_dec[expert] == 1 and cols_s_dec[expert] == 1
            continue
        want, want_s_dec = reference(x[start:stop])
        assert torch.equal(rows[start:stop], want) and rows_s_dec[expert] == want_s_dec
        want, want_s_dec = reference(x[start:stop], rowwise=False, columnwise=True,
                                     with_rht=with_rht)
        assert torch.equal(cols[:, start:stop], want) and cols_s_dec[expert] == want_s_dec


@pytest.mark.parametrize("two_dimensional", [True, False])
def test_weight_values_are_each_experts_own_quantization(two_dimensional):
    """The stacked weights [E, N, K]: rowwise and columnwise values and S_dec of each expert
    equal numerics' quantization of that expert's weight alone (2-D tiles: the columnwise copy
    is the transposed tiles; 1-D: W_e^T quantized along N)."""
    weight = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(1))
    weight[1] *= 50.0
    cast = NVFP4Cast(two_dimensional=two_dimensional)
    rows, rows_s_dec = weight_values(weight_copy(weight, cast, columnwise=False), weight.shape,
                                     cast, columnwise=False)
    cols, cols_s_dec = weight_values(weight_copy(weight, cast, columnwise=True), weight.shape,
                                     cast, columnwise=True)
    for expert in range(3):
        want, want_s_dec = reference(weight[expert], two_dimensional=two_dimensional)
        assert torch.equal(rows[expert], want) and rows_s_dec[expert] == want_s_dec
        want, want_s_dec = reference(weight[expert], rowwise=False, columnwise=True,
                                     two_dimensional=two_dimensional)
        assert torch.equal(cols[expert], want) and cols_s_dec[expert] == want_s_dec


def test_nan_in_one_experts_rows_stays_in_that_expert():
    ends, spans = layout_of([20, 20])
    x = torch.randn(int(ends[-1]), 32)
    x[spans[0][0] + 3, 5] = float("nan")
    values, s_dec = rows_values(x, ends, NVFP4Cast())
    assert torch.isnan(s_dec[0]) and torch.isfinite(s_dec[1])
    assert torch.isfinite(values[spans[1][0]:spans[1][1]]).all()


@pytest.mark.parametrize("recipe", [
    SR_OFF, mf.NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True),
    mf.NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True)],
    ids=["default-without-sr", "1d-weights", "no-rht"])
@pytest.mark.parametrize("empty_expert", [None, 2])
def test_device_offsets_equal_the_general_path(nvfp4_calls, recipe, empty_expert):
    """Outputs and gradients equal the general path's (per-expert quantizers, host splits) to
    summation order: each group quantized with its own global scale, S_dec(a) * S_dec(b)
    applied to the fp32 sums."""
    torch.manual_seed(0)
    experts = fused_experts(4, 64, 48)
    inputs = routed(tokens=40, hidden=64, empty_expert=empty_expert)
    assert_paths_agree(experts, inputs, recipe, nvfp4_calls)


def test_stochastic_rounding_errs_as_the_general_paths_does(nvfp4_calls):
    """The default recipe (SR on gradients): the gradients differ from round-to-nearest's
    (SR is applied), repeat under a seed, and their mean error against the unquantized experts
    over four seeds is within 10% of the general path's (different draws, same distribution)."""
    experts = fused_experts(4, 64, 48)
    inputs = routed(tokens=40, hidden=64)
    x = inputs[0].clone().requires_grad_(True)
    y = experts(x, *inputs[1:3])
    y.backward(inputs[3])
    exact = [x.grad, *[p.grad.clone() for p in experts.parameters()]]
    experts.zero_grad(set_to_none=True)

    def errors(mode: str, recipe: mf.Recipe, seed: int) -> list[float]:
        torch.manual_seed(seed)
        with fused_experts_module.offsets_mode(mode):
            _, dx, grads, _ = run(experts, *inputs, recipe=recipe)
        return [rel_err(a, b) for a, b in zip((dx, *grads), exact, strict=True)]

    recipe = mf.NVFP4BlockScaling()
    device_runs = [errors("always", recipe, seed) for seed in range(4)]
    general = torch.tensor([errors("never", recipe, seed) for seed in range(4)],
                           dtype=torch.float64)
    assert len(nvfp4_calls) == 8
    assert errors("always", recipe, 0) == device_runs[0]  # reproducible under a seed
    assert errors("always", SR_OFF, 0) != device_runs[0]
    device = torch.tensor(device_runs, dtype=torch.float64)
    assert ((device.mean(0) / general.mean(0) - 1).abs() < 0.1).all(), (device, general)


def test_unserved_settings_keep_the_host_counts_path():
    """The RHT on one wgrad operand only (it would not cancel) or on the weight, and a
    non-NVFP4 quantizer among the experts': no plan."""
    def plan(input_q, weight_q, grad_q):
        return offsets_nvfp4([input_q] * 2, [weight_q] * 2, [grad_q] * 2)

    rht, plain = NVFP4Quantizer(with_rht=True), NVFP4Quantizer()
    weight = NVFP4Quantizer(with_2d_quantization=True)
    assert plan(rht, weight, NVFP4Quantizer(with_rht=True, stochastic_rounding=True)) is not None
    assert plan(rht, weight, plain) is None
    assert plan(plain, rht, plain) is None
    assert offsets_nvfp4([rht, plain], [weight] * 2, [rht] * 2) is None
    assert offsets_nvfp4([rht] * 2, [weight, mf.quantizers.MXFP8Quantizer()], [rht] * 2) is None


def test_compiled_mixtral_under_the_default_recipe_is_one_graph():
    """NVFP4BlockScaling as it comes (SR on): fullgraph=True traces the experts, the loss is
    eager's bit for bit (no randomness forward), the gradients are finite and near eager's
    (other draws), and a new routing reuses the graph."""
    model, eager, got, want, graphs = compiled_and_eager_mixtral(mf.NVFP4BlockScaling(), 64,
                                                                 seq=16)
    assert torch.equal(got["loss"], want["loss"]) and graphs == [1, 1]
    for part in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{part}"
        grad, ref = got["grads"][name], want["grads"][name]
        assert torch.isfinite(grad).all() and rel_err(grad, ref) < 0.5, name
