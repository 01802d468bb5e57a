"""Fused dequantize-GEMM (kernels/fused_gemm.py) against the library's bf16 emulated path.

The fused kernel multiplies the same bf16 operands the current path decodes (dequantize.py), so:
- through an identity operand (every output one product times 1) it must return the decoded
  values exactly, NaN where they are NaN: this checks every decode bit for bit, fast and general
  scale paths, both operand sides;
- on quantized random tensors its fp32 accumulator must match the float64 product of the decoded
  operands within fp32 summation error (1e-5 of sum |a||b|, observed far below), and its bf16
  output must equal general_gemm's but for one-ulp differences at rounding boundaries.
Shapes: M, N any (awkward ones here), K a multiple of 32 (MXFP8) / 16 (NVFP4), tails masked.
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 with tiny tiles (tl.dot_scaled: CUDA only).
"""

from __future__ import annotations

import pytest
import torch

from minifloat import kernels, numerics

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip("needs CUDA with Triton, or TRITON_INTERPRET=1", allow_module_level=True)

import minifloat as mf  # noqa: E402
from minifloat.kernels import fused_gemm as fg  # noqa: E402
from minifloat.kernels.dequantize import (  # noqa: E402
    dequantize_mxfp8_bf16,
    dequantize_nvfp4_blocks_bf16,
)
from minifloat.quantizers import as_storage  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

CUDA = DEVICE.type == "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# on CUDA the default tiles (the benchmark checks its tuned ones against the current path at
# size); the interpreter gets tiny ones
CONFIGS = [fg.DEFAULT_CONFIG] if CUDA else [(32, 32, 64, 4, 1)]
MX_DECODES = ["lib", "cvt", "dot_scaled"] if CUDA else ["lib", "cvt"]
NV_DECODES = ["lib", "bits"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def same_values(got, ref, label=""):
    """Equal as numbers (-0 == +0), NaN exactly where the reference is NaN."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, (label, got.shape, ref.shape)
    bad = (got.isnan() != ref.isnan()) | (~ref.isnan() & (got != ref))
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{label}: {int(bad.sum())} of {bad.numel()} differ, first at "
                             f"{first}: {got[first].item()} instead of {ref[first].item()}")


def mx_random(rows, k, dtype, seed, scale_low, scale_high):
    """Random non-NaN (non-inf) codes and E8M0 bytes in [scale_low, scale_high]."""
    codes = torch.randint(0, 256, (rows, k), generator=gen(seed), dtype=torch.int32)
    bad = (codes & 0x7F) == 0x7F if dtype == E4M3 else (codes & 0x7F) >= 0x7C
    codes = torch.where(bad, codes & 0x80, codes).to(torch.uint8).view(dtype)
    scale = torch.randint(scale_low, scale_high + 1, (rows, k // 32), generator=gen(seed + 1),
                          dtype=torch.int32).to(torch.uint8)
    return codes.to(DEVICE), scale.to(DEVICE)


def mx_identity(n, dtype):
    one = 0x38 if dtype == E4M3 else 0x3C
    codes = (torch.eye(n, dtype=torch.int32) * one).to(torch.uint8).view(dtype)
    return codes.to(DEVICE), torch.full((n, n // 32), 127, dtype=torch.uint8, device=DEVICE)


@pytest.mark.parametrize("decode", MX_DECODES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("general", [False, True], ids=["fast", "general"])
@pytest.mark.parametrize("config", CONFIGS)
def test_mxfp8_identity_decodes_exactly(decode, dtype, general, config):
    """Scale bytes from the fast range's floor (every decoded value a bf16 normal, so tensor
    cores cannot flush it) to its ceiling, or past it (general path) to the overflow edge."""
    m, k = (96, 160) if CUDA else (48, 96)
    _, _, low, high = fg.E5M2_DECODE if dtype == E5M2 else fg.E4M3_DECODE
    data, scale = mx_random(m, k, dtype, 1, low, 238 if general else high)
    eye, eye_scale = mx_identity(k, dtype)
    ref = dequantize_mxfp8_bf16(data, scale)
    got = fg.fused_mxfp8_gemm(data, scale, eye, eye_scale, decode=decode, config=config)
    same_values(got, ref, "A side")
    got = fg.fused_mxfp8_gemm(eye, eye_scale, data, scale, decode=decode, config=config)
    same_values(got, ref.t(), "B side")


@pytest.mark.parametrize("decode", MX_DECODES)
def test_mxfp8_nan_propagates(decode):
    m, k = 64, 128
    data, scale = mx_random(m, k, E4M3, 2, 100, 130)
    data.view(torch.uint8)[3, 17] = 0x7F  # a NaN code
    scale[9, 2] = 255  # a NaN scale
    other, other_scale = mx_random(64, k, E4M3, 3, 100, 130)
    ref = torch.mm(dequantize_mxfp8_bf16(data, scale).double(),
                   dequantize_mxfp8_bf16(other, other_scale).double().t())
    got = fg.fused_mxfp8_gemm(data, scale, other, other_scale, decode=decode,
                              config=CONFIGS[0])
    assert torch.equal(got.isnan().cpu(), ref.isnan().cpu())
    assert got.isnan()[3].all() and got.isnan()[9].all()


def check_against_decoded(got_fp32, a_values, b_values, alpha=None):
    """|fused - exact| <= 1e-5 * (|A| @ |B|^T) elementwise (fp32 summation error)."""
    a, b = a_values.double().cpu(), b_values.double().cpu()
    exact, bound = a @ b.t(), a.abs() @ b.abs().t()
    got = got_fp32.double().cpu()
    ratio = ((got - exact).abs() / bound.clamp_min(1e-30)).max().item()
    assert ratio < 1e-5, ratio
    return ratio


def check_bf16(got, expected):
    """bf16 outputs equal but for one-ulp steps where fp32 sums fall either side of a tie."""
    g, e = got.cpu().view(torch.int16).int(), expected.cpu().view(torch.int16).int()
    assert (g - e).abs().max().item() <= 1
    assert (g != e).float().mean().item() < 0.02


SHAPES = [(256, 512, 384), (96, 160, 224)] if CUDA else [(32, 96, 64)]


@pytest.mark.parametrize("decode", MX_DECODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_mxfp8_quantized_matches_current_path(decode, shape, config):
    m, k, n = shape
    torch.manual_seed(0)
    quantizer = mf.MXFP8Quantizer(E4M3, rowwise=True, columnwise=False)
    qa = quantizer(torch.randn(m, k, device=DEVICE))
    qb = quantizer(torch.randn(n, k, device=DEVICE) * 0.02)
    sa, sb = as_storage(qa), as_storage(qb)
    acc = fg.fused_mxfp8_gemm(sa.rowwise_data, sa.rowwise_scale, sb.rowwise_data,
                              sb.rowwise_scale, decode=decode, config=config, out_fp32=True)
    check_against_decoded(acc, dequantize_mxfp8_bf16(sa.rowwise_data, sa.rowwise_scale),
                          dequantize_mxfp8_bf16(sb.rowwise_data, sb.rowwise_scale))
    got = fg.fused_gemm(qa, qb, decode=decode, config=config)
    check_bf16(got, mf.general_gemm(qa, qb, out_dtype=torch.bfloat16))


def pack(codes):
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def nv_random(rows, k, seed):
    codes = torch.randint(0, 16, (rows, k), generator=gen(seed), dtype=torch.int32)
    scale = torch.randint(0, 0xFF, (rows, k // 16), generator=gen(seed + 1), dtype=torch.int32)
    scale = torch.where(scale == 0x7F, 0x7E, scale).to(torch.uint8)  # every non-NaN byte
    return pack(codes).to(DEVICE), scale.to(DEVICE).view(E4M3)


@pytest.mark.parametrize("decode", NV_DECODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_nvfp4_identity_decodes_exactly(decode, config):
    m, k = (96, 144) if CUDA else (48, 80)
    data, scale = nv_random(m, k, 4)
    eye = pack(torch.eye(k, dtype=torch.int32) * 2).to(DEVICE)  # E2M1 code 2 = 1.0
    eye_scale = torch.full((k, k // 16), 0x38, dtype=torch.uint8, device=DEVICE).view(E4M3)
    one = torch.ones(1, device=DEVICE)
    ref = dequantize_nvfp4_blocks_bf16(data, scale)
    same_values(fg.fused_nvfp4_gemm(data, scale, eye, eye_scale, one, decode=decode,
                                    config=config), ref, "A side")
    same_values(fg.fused_nvfp4_gemm(eye, eye_scale, data, scale, one, decode=decode,
                                    config=config), ref.t(), "B side")


@pytest.mark.parametrize("decode", NV_DECODES)
def test_nvfp4_nan_scale_propagates(decode):
    data, scale = nv_random(64, 128, 5)
    scale.view(torch.uint8)[7, 3] = 0x7F
    other, other_scale = nv_random(32, 128, 6)
    got = fg.fused_nvfp4_gemm(data, scale, other, other_scale, torch.ones(1, device=DEVICE),
                              decode=decode, config=CONFIGS[0])
    assert got.isnan()[7].all() and got.isnan().sum().item() == 32


NV_SHAPES = [(256, 512, 384), (80, 144, 112)] if CUDA else [(32, 80, 48)]


@pytest.mark.parametrize("decode", NV_DECODES)
@pytest.mark.parametrize("shape", NV_SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_nvfp4_quantized_matches_current_path(decode, shape, config):
    m, k, n = shape
    torch.manual_seed(0)
    qa = mf.NVFP4Quantizer(rowwise=True, columnwise=False)(torch.randn(m, k, device=DEVICE))
    qb = mf.NVFP4Quantizer(rowwise=True, columnwise=False, with_2d_quantization=True)(
        torch.randn(n, k, device=DEVICE) * 0.02)
    sa, sb = as_storage(qa), as_storage(qb)
    alpha = (numerics.global_decode_scale(sa.amax_rowwise)
             * numerics.global_decode_scale(sb.amax_rowwise)).float()
    acc = fg.fused_nvfp4_gemm(sa.rowwise_data, sa.rowwise_scale, sb.rowwise_data,
                              sb.rowwise_scale, torch.ones(1, device=DEVICE), decode=decode,
                              config=config, out_fp32=True)
    check_against_decoded(acc, dequantize_nvfp4_blocks_bf16(sa.rowwise_data, sa.rowwise_scale),
                          dequantize_nvfp4_blocks_bf16(sb.rowwise_data, sb.rowwise_scale))
    scaled = fg.fused_nvfp4_gemm(sa.rowwise_data, sa.rowwise_scale, sb.rowwise_data,
                                 sb.rowwise_scale, alpha, decode=decode, config=config,
                                 out_fp32=True)
    assert torch.equal(scaled, acc * alpha)  # the epilogue: one fp32 multiply
    got = fg.fused_gemm(qa, qb, decode=decode, config=config)
    check_bf16(got, mf.general_gemm(qa, qb, out_dtype=torch.bfloat16))
