"""The emulated GEMM (gemm.py): out = alpha * (a @ b^T) + bias, fp32 accumulation.

Reference: float64 matmul of the same (dequantized) operands. Products of two bf16-exact values
(8 significant bits each) are exact in fp32 (16 bits), so the only fp32 error is in the sum:
|fl(sum) - sum| <= gamma_K * sum |a_i b_i| with gamma_K = K u / (1 - K u), u = 2^-24, for any
summation order (Higham, Accuracy and Stability, Thm 3.1 / eq. 3.5).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minifloat.numerics import (
    dequantize_block_1d,
    dequantize_block_2d,
    dequantize_mxfp8,
    dequantize_nvfp4,
    dequantize_nvfp4_blocks,
    emulated_gemm_tn,
    global_decode_scale,
    quantize_block_1d,
    quantize_block_2d,
    quantize_mxfp8,
    quantize_nvfp4,
)

U = 2.0**-24


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def check_fp32_sum_bound(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, extra=0.0):
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64.t()
    bound = gamma(a.shape[1]) * (a64.abs() @ b64.abs().t()) + extra
    assert out.dtype == torch.float32
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), float((err - bound).max())


def test_plain_fp32_bound_and_shape():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(24, 256, generator=g).to(torch.bfloat16)
    out = emulated_gemm_tn(a, b)
    assert out.shape == (16, 24)
    check_fp32_sum_bound(out, a, b)


def test_exact_on_small_integers():
    # |products| <= 64 * 64 and K = 128: every partial sum < 2^24, so fp32 is exact
    g = torch.Generator().manual_seed(2)
    a = torch.randint(-64, 65, (8, 128), generator=g).float()
    b = torch.randint(-64, 65, (12, 128), generator=g).float()
    out = emulated_gemm_tn(a, b)
    assert torch.equal(out.double(), a.double() @ b.double().t())


def test_alpha_then_bias():
    # alpha multiplies the accumulated product only; the bias is added after (not scaled)
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = torch.tensor([[1.0, 1.0], [2.0, -1.0], [0.5, 0.0]])
    # a @ b^T = [[3, 0, 0.5], [7, 2, 1.5]]; * 0.5 = [[1.5, 0, 0.25], [3.5, 1, 0.75]]; + bias
    out = emulated_gemm_tn(a, b, alpha=torch.tensor(0.5), bias=torch.tensor([1.0, 10.0, -1.0]))
    assert out.tolist() == [[2.5, 10.0, -0.75], [4.5, 11.0, -0.25]]
    out_bf16 = emulated_gemm_tn(a, b, bias=torch.tensor([0.0, 0.0, 1.0]),
                                out_dtype=torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16
    assert out_bf16.float().tolist() == [[3.0, 0.0, 1.5], [7.0, 2.0, 2.5]]


def test_alpha_is_applied_in_fp32_after_accumulation():
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 9, (4, 64), generator=g).float()
    b = torch.randint(-8, 9, (5, 64), generator=g).float()
    alpha = torch.tensor(1.0 / 3.0)  # fp32(1/3)
    bias = torch.randn(5, generator=g)
    out = emulated_gemm_tn(a, b, alpha=alpha, bias=bias)
    acc = (a.double() @ b.double().t()).numpy().astype(np.float32)  # exact integers
    expected = acc * np.float32(alpha.item()) + bias.numpy()  # two fp32 roundings
    assert np.array_equal(out.numpy(), expected.astype(np.float32))


def test_out_dtype_rounds_the_fp32_result():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(8, 64, generator=g)
    b = torch.randn(8, 64, generator=g)
    fp32 = emulated_gemm_tn(a, b)
    assert torch.equal(emulated_gemm_tn(a, b, out_dtype=torch.bfloat16), fp32.to(torch.bfloat16))


@pytest.mark.parametrize(
    "sa,sb",
    [((4, 32), (4, 16)), ((32,), (4, 32)), ((2, 4, 32), (4, 32)), ((4, 32), (32, 4))],
)
def test_shape_mismatch(sa, sb):
    with pytest.raises(ValueError, match="same K"):
        emulated_gemm_tn(torch.ones(sa), torch.ones(sb))


def test_nan_and_inf_propagate():
    a = torch.ones(3, 4)
    a[1, 2] = math.nan
    a[2, 0] = math.inf
    out = emulated_gemm_tn(a, torch.ones(2, 4))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
    assert (out[2] == math.inf).all()


def test_mxfp8_operands():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=g)
    w = torch.randn(32, 128, generator=g) * 0.02
    qx, qw = quantize_mxfp8(x), quantize_mxfp8(w)
    a = dequantize_mxfp8(qx["rowwise_data"], qx["rowwise_scale"])
    b = dequantize_mxfp8(qw["rowwise_data"], qw["rowwise_scale"])
    out = emulated_gemm_tn(a, b)
    check_fp32_sum_bound(out, a, b)
    # and it approximates the high-precision product (E4M3 relative error <= 2^-4 per operand)
    ref = x.double() @ w.double().t()
    assert ((out.double() - ref).abs() <= (2 * 2.0**-4 + 2.0**-8) * (
        x.double().abs() @ w.double().abs().t()) + 1e-6).all()


def test_block_fp8_operands_1d_x_2d():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(130, 256, generator=g)
    w = torch.randn(200, 256, generator=g)
    a = dequantize_block_1d(*quantize_block_1d(x))
    b = dequantize_block_2d(*quantize_block_2d(w))
    check_fp32_sum_bound(emulated_gemm_tn(a, b), a, b)


def test_nvfp4_operands_with_alpha():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 128, generator=g) * 3
    w = torch.randn(48, 128, generator=g) * 0.1
    qx, qw = quantize_nvfp4(x), quantize_nvfp4(w, two_dimensional=True)
    a = dequantize_nvfp4_blocks(qx["rowwise_data"], qx["rowwise_scale"])  # q * s_b: bf16-exact
    b = dequantize_nvfp4_blocks(qw["rowwise_data"], qw["rowwise_scale"])
    alpha = global_decode_scale(qx["amax_rowwise"]) * global_decode_scale(qw["amax_rowwise"])
    out = emulated_gemm_tn(a, b, alpha=alpha.reshape(()))
    exact = (a.double() @ b.double().t()) * alpha.double().item()
    # fp32 sum error, then one fp32 rounding of the product with alpha (relative 2^-24)
    bound = (gamma(128) * (a.double().abs() @ b.double().abs().t()) * alpha.double().item()) * (
        1 + U) + U * exact.abs()
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()
    # equals the GEMM of fully dequantized operands up to the same kind of rounding
    fx = dequantize_nvfp4(qx["rowwise_data"], qx["rowwise_scale"], qx["amax_rowwise"]).double()
    fw = dequantize_nvfp4(qw["rowwise_data"], qw["rowwise_scale"], qw["amax_rowwise"]).double()
    full = fx @ fw.t()
    scale = (a.double().abs() @ b.double().abs().t()) * alpha.double().item()
    assert ((out.double() - full).abs() <= 1e-5 * scale + 1e-30).all()
