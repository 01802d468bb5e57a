"""FP8 block scaling, DeepSeek style (NUMERICS.md §4): 1x128 rows, x^T runs along M, 128x128 tiles.

The reference is a per-block scalar Python loop: block amax in Python floats, the §2 scale rules
in numpy float32, and a pure-Python saturating RNE E4M3 encoder for the elements.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from minifloat.numerics import (
    FLT_MAX,
    dequantize_block_1d,
    dequantize_block_2d,
    quantize_block_1d,
    quantize_block_1d_columnwise,
    quantize_block_2d,
    transpose_block_2d,
)

F32 = np.float32
BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # (2 - 2^-7) * 2^127


# ---------------------------------------------------------------- scalar reference


def f32_bits(v) -> int:
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


def e4m3_byte(x: float) -> int | None:
    """Pure-Python saturating RNE E4M3 encoder (bias 7, 3 mantissa bits, max 448); None = NaN."""
    if math.isnan(x):
        return None
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), 448.0)
    if a == 0:
        return sign
    e = max(math.frexp(a)[1] - 1, -6)
    quantum = math.ldexp(1.0, e - 3)
    n = round(a / quantum)  # half to even
    if n == 0:
        return sign
    v = n * quantum
    if v < 2.0**-6:
        return sign | n
    ve = math.frexp(v)[1] - 1
    return sign | ((ve + 7) << 3) | (int(v / math.ldexp(1.0, ve - 3)) - 8)


def e4m3_value(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10))


def ref_scale(amax: float, overflow: float, pow2: bool, eps: float = 0.0) -> float:
    with np.errstate(all="ignore"):
        a = F32(amax)
        if a < F32(eps):
            a = F32(eps)
        if a == 0 or not np.isfinite(a):
            s = F32(1.0)
        else:
            s = F32(448.0) / a
            if np.isinf(s):
                s = F32(overflow)
    if pow2:
        s = np.array([f32_bits(s) & 0xFF800000], dtype=np.uint32).view(np.float32)[0]
    return float(s)


def ref_quantize_tiles(x2d: torch.Tensor, rows: int, cols: int, pow2=True, eps=0.0):
    """Per-tile scalar loops -> (bytes [M][K] with None for NaN, scale_inv [tm][tk])."""
    overflow = float(torch.finfo(x2d.dtype).max)
    vals = x2d.float().tolist()
    m, k = len(vals), len(vals[0])
    tm, tk = -(-m // rows), -(-k // cols)
    data = [[0] * k for _ in range(m)]
    scale_inv = [[0.0] * tk for _ in range(tm)]
    for bi in range(tm):
        for bj in range(tk):
            r0, r1 = bi * rows, min(m, bi * rows + rows)
            c0, c1 = bj * cols, min(k, bj * cols + cols)
            amax = 0.0
            for r in range(r0, r1):
                for c in range(c0, c1):
                    a = abs(vals[r][c])
                    amax = math.nan if math.isnan(a) or math.isnan(amax) else max(amax, a)
            s = ref_scale(amax, overflow, pow2, eps)
            scale_inv[bi][bj] = float(F32(1.0) / F32(s))
            for r in range(r0, r1):
                for c in range(c0, c1):
                    with np.errstate(all="ignore"):
                        prod = float(F32(vals[r][c]) * F32(s))  # the fp32 product
                    data[r][c] = e4m3_byte(prod)
    return data, scale_inv


def assert_matches(data: torch.Tensor, scale_inv: torch.Tensor, ref) -> None:
    ref_data, ref_scale_inv = ref
    assert data.dtype == torch.float8_e4m3fn
    assert scale_inv.dtype == torch.float32
    assert scale_inv.tolist() == ref_scale_inv
    got = data.view(torch.uint8).tolist()
    assert len(got) == len(ref_data)
    for r, (grow, erow) in enumerate(zip(got, ref_data, strict=True)):
        for c, (gb, eb) in enumerate(zip(grow, erow, strict=True)):
            if eb is None:
                assert gb & 0x7F == 0x7F, (r, c, gb)
            else:
                assert gb == eb, (r, c, hex(gb), hex(eb))


def varied_blocks(m: int, k: int, seed: int, block_rows: int = 1, block_cols: int = 128):
    """Random values whose per-block magnitude varies over many binades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    tm, tk = -(-m // block_rows), -(-k // block_cols)
    mag = torch.exp2(torch.randint(-30, 30, (tm, tk), generator=g).float())
    mag = mag.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:m, :k]
    return x * mag


# ---------------------------------------------------------------- 1D rowwise / columnwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1d_rowwise_vs_scalar_reference(dtype):
    x = varied_blocks(6, 300, seed=1)  # 300 = 2 * 128 + 44: a partial edge block
    x[1] = 0.0  # an all-zero row: scale 1
    x[2, 5] = 1e30  # one huge value among ordinary ones (block 0 only)
    x[3, 130] = math.inf  # inf: block amax inf -> scale 1, inf saturates to 448
    x[4, 260] = math.nan  # NaN in the edge block: scale 1, NaN stays NaN
    x[5, 0:128] = 2.0**-130  # tiny block: 448/amax overflows -> the dtype's max -> 2^127
    x[5, 128] = -0.0
    x = x.to(dtype)
    data, scale_inv = quantize_block_1d(x)
    assert data.shape == (6, 300) and scale_inv.shape == (6, 3)
    assert_matches(data, scale_inv, ref_quantize_tiles(x, 1, 128))
    # spot checks written out by hand
    assert scale_inv[1].tolist() == [1.0, 1.0, 1.0]
    assert scale_inv[3, 1].item() == 1.0 and data.view(torch.uint8)[3, 130].item() == 0x7E
    assert data.view(torch.uint8)[4, 260].item() & 0x7F == 0x7F
    assert scale_inv[5, 0].item() == 2.0**-127  # scale 2^127 (power of two, rounded down)
    assert data.view(torch.uint8)[5, 128].item() == 0x80


def test_1d_power_of_two_scales():
    x = varied_blocks(8, 512, seed=2) * 1.37
    _, scale_inv = quantize_block_1d(x)
    assert ((scale_inv.view(torch.int32) & 0x7FFFFF) == 0).all()
    amax = x.abs().reshape(8, 4, 128).amax(-1).double()
    # scale = 2^floor(log2(448 / amax)): scaled block amax lies in (224, 448]
    scaled = amax / scale_inv.double()
    assert ((scaled > 224) & (scaled <= 448)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1d_columnwise_runs_along_m(dtype):
    x = varied_blocks(130, 40, seed=3, block_rows=128, block_cols=1)  # blocks along M
    x[129, 7] = 3e4  # the partial M block of column 7 (only rows 128, 129)
    x[0:128, 3] = 0.0
    x = x.to(dtype)
    data, scale_inv = quantize_block_1d_columnwise(x)
    assert data.shape == (40, 130) and scale_inv.shape == (40, 2)
    assert_matches(data, scale_inv, ref_quantize_tiles(x.t(), 1, 128))
    # not derivable from the rowwise copy: the transposed rowwise data has other scales
    row_data, _ = quantize_block_1d(x)
    assert not torch.equal(row_data.view(torch.uint8).t(), data.view(torch.uint8))


def test_1d_three_dim_input_uses_2d_view():
    x = varied_blocks(6, 256, seed=4).reshape(2, 3, 256)
    d3, s3 = quantize_block_1d(x)
    assert d3.shape == (6, 256) and s3.shape == (6, 2)
    assert_matches(d3, s3, ref_quantize_tiles(x.reshape(6, 256), 1, 128))
    dc, sc = quantize_block_1d_columnwise(x)
    assert dc.shape == (256, 6) and sc.shape == (256, 1)


def test_partial_edge_block_uses_existing_elements():
    # block 0: amax 1 -> scale = 2^floor(log2 448) = 256; block 1 (2 elements): amax 2^-12 ->
    # 448 * 2^12 -> scale 2^20, so 2^-12 -> 256 (0 1111 000 = 0x78), -2^-13 -> -128 (0xF0)
    x = torch.full((1, 130), 0.5)
    x[0, 0] = 1.0
    x[0, 128], x[0, 129] = 2.0**-12, -(2.0**-13)
    data, scale_inv = quantize_block_1d(x)
    assert scale_inv.tolist() == [[2.0**-8, 2.0**-20]]
    b = data.view(torch.uint8)
    assert b[0, 0].item() == 0x78  # 1.0 * 256 = 2^8: exponent field 8 + 7 = 15 -> 0 1111 000
    assert b[0, 1].item() == 0x70  # 0.5 * 256 = 2^7: 0 1110 000
    assert b[0, 128].item() == 0x78 and b[0, 129].item() == 0xF0
    # columnwise: the same along M
    data_c, scale_inv_c = quantize_block_1d_columnwise(x.t().contiguous())
    assert scale_inv_c.tolist() == [[2.0**-8, 2.0**-20]]
    assert torch.equal(data_c.view(torch.uint8), b)


def test_scale_overflow_gives_input_dtype_max():
    # amax 2^-130: 448 / 2^-130 overflows fp32 -> the input dtype's max (non-power-of-2 scales)
    for dtype, dmax in ((torch.float32, FLT_MAX), (torch.bfloat16, BF16_MAX)):
        x = torch.full((2, 128), 2.0**-130, dtype=dtype)
        x[1] = -(2.0**-131)
        data, scale_inv = quantize_block_1d(x, power_2_scale=False)
        assert scale_inv[:, 0].tolist() == [float(F32(1) / F32(dmax))] * 2
        # element: 2^-130 * dmax = 0.2499.. (fp32) or 0.2490.. (bf16 max) -> E4M3 0.25 = 0x28
        assert (data.view(torch.uint8)[0] == 0x28).all()
        assert (data.view(torch.uint8)[1] == 0xA0).all()  # -2^-131 * dmax ~ -0.125 = 1 0100 000
        assert_matches(data, scale_inv, ref_quantize_tiles(x, 1, 128, pow2=False))
        # with power-of-2 scales the max rounds down to 2^127
        _, s2 = quantize_block_1d(x)
        assert s2[:, 0].tolist() == [2.0**-127] * 2


def test_non_power_of_two_scales_exact_amaxes():
    # block amaxes 7 * 2^k and 2^k: 448 / amax is exact (hand-checkable scales 64 * 2^-k etc.)
    x = varied_blocks(4, 256, seed=5).clamp(-0.99, 0.99)
    amaxes = [7.0, 2.0**-5, 7 * 2.0**10, 1.0, 2.0**20, 7 * 2.0**-20, 0.5, 3.5]
    for i, a in enumerate(amaxes):
        r, b = divmod(i, 2)
        x[r, b * 128 : (b + 1) * 128] *= a
        x[r, b * 128 + (i * 13) % 128] = -a
    data, scale_inv = quantize_block_1d(x, power_2_scale=False)
    assert_matches(data, scale_inv, ref_quantize_tiles(x, 1, 128, pow2=False))


def test_non_power_of_two_scales_random_amaxes():
    x = varied_blocks(8, 384, seed=6) * 1.2345
    data, scale_inv = quantize_block_1d(x, power_2_scale=False)
    assert_matches(data, scale_inv, ref_quantize_tiles(x, 1, 128, pow2=False))


def test_power_of_two_scale_huge_amax():
    # a bf16 block with amax 1.75 * 2^127: scale = 448 / amax = 2^-119 exactly (one division);
    # fp32(1/amax) * 448 (subnormal reciprocal) would give 2^-120 and the element 224 (0x76)
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    x[0, 0] = 1.75 * 2.0**127
    data, scale_inv = quantize_block_1d(x)
    assert scale_inv.item() == 2.0**119
    assert data.view(torch.uint8)[0, 0].item() == 0x7E


def test_amax_epsilon_blocks():
    x = torch.zeros(2, 128)
    x[1] = 1e-9
    data, scale_inv = quantize_block_1d(x, amax_epsilon=2.0**-4, power_2_scale=False)
    # both blocks' amax is raised to 1/16: scale 448 * 16 = 7168
    assert scale_inv[:, 0].tolist() == [float(F32(1) / F32(7168.0))] * 2
    assert_matches(data, scale_inv, ref_quantize_tiles(x, 1, 128, pow2=False, eps=2.0**-4))


def test_1d_dequantize_and_error_bound():
    x = varied_blocks(4, 384, seed=7)
    data, scale_inv = quantize_block_1d(x)
    deq = dequantize_block_1d(data, scale_inv)
    b = data.view(torch.uint8).tolist()
    for r in range(4):
        for c in range(0, 384, 7):
            assert deq[r, c].item() == e4m3_value(b[r][c]) * scale_inv[r, c // 128].item()
    # RNE error: <= 2^-4 relative (3 mantissa bits), <= 2^-10 quanta in the subnormal range
    bound = x.abs() * 2.0**-4 + scale_inv.repeat_interleave(128, 1) * 2.0**-10
    assert ((deq - x).abs() <= bound).all()
    assert dequantize_block_1d(data, scale_inv, torch.bfloat16).dtype == torch.bfloat16
    # the columnwise layout dequantizes to x^T
    dc, sc = quantize_block_1d_columnwise(x)
    deq_c = dequantize_block_1d(dc, sc)
    assert deq_c.shape == (384, 4)
    assert ((deq_c - x.t()).abs() <= x.t().abs() * 2.0**-4 + 2.0**-10 * sc.max()).all()


# ---------------------------------------------------------------- 2D tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_vs_scalar_reference(dtype):
    x = varied_blocks(130, 200, seed=8, block_rows=128, block_cols=128)
    x[128:130, 0:128] = 0.0  # bottom-left partial tile: zeros -> scale 1
    x[10, 150] = 5e6  # one huge value in tile (0, 1)
    x[128:130, 128:200] = 2.0**-41  # bottom-right partial tile (2 x 72): tiny values
    x[129, 199] = -(2.0**-40)
    x[128, 130] = 3 * 2.0**-41
    x = x.to(dtype)
    data, scale_inv = quantize_block_2d(x)
    assert data.shape == (130, 200) and scale_inv.shape == (2, 2)
    assert_matches(data, scale_inv, ref_quantize_tiles(x, 128, 128))
    assert scale_inv[1, 0].item() == 1.0
    # bottom-right amax 2^-40: scale = 2^floor(log2(448 * 2^40)) = 2^48
    assert scale_inv[1, 1].item() == 2.0**-48


def test_2d_nan_and_inf_tiles():
    x = varied_blocks(256, 256, seed=9, block_rows=128, block_cols=128)
    x[3, 200] = math.nan  # tile (0, 1)
    x[200, 3] = -math.inf  # tile (1, 0)
    data, scale_inv = quantize_block_2d(x)
    assert scale_inv[0, 1].item() == 1.0 and scale_inv[1, 0].item() == 1.0
    b = data.view(torch.uint8)
    assert b[3, 200].item() & 0x7F == 0x7F and b[200, 3].item() == 0xFE
    assert_matches(data, scale_inv, ref_quantize_tiles(x, 128, 128))


def test_2d_transpose_equals_quantization_of_transpose():
    x = varied_blocks(130, 300, seed=10, block_rows=128, block_cols=128).to(torch.bfloat16)
    data, scale_inv = quantize_block_2d(x)
    data_t, scale_inv_t = transpose_block_2d(data, scale_inv)
    ref_t, ref_st = quantize_block_2d(x.t())
    assert data_t.shape == (300, 130) and scale_inv_t.shape == (3, 2)
    assert torch.equal(data_t.view(torch.uint8), ref_t.view(torch.uint8))
    assert torch.equal(scale_inv_t, ref_st)
    assert_matches(data_t, scale_inv_t, ref_quantize_tiles(x.t(), 128, 128))
    # and back
    back, back_s = transpose_block_2d(data_t, scale_inv_t)
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(back_s, scale_inv)


def test_2d_dequantize():
    x = varied_blocks(130, 200, seed=11, block_rows=128, block_cols=128)
    data, scale_inv = quantize_block_2d(x)
    deq = dequantize_block_2d(data, scale_inv)
    b = data.view(torch.uint8).tolist()
    for r in range(0, 130, 3):
        for c in range(0, 200, 11):
            assert deq[r, c].item() == e4m3_value(b[r][c]) * scale_inv[r // 128, c // 128].item()
    bound = x.abs() * 2.0**-4 + scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[
        :130, :200
    ] * 2.0**-10
    assert ((deq - x).abs() <= bound).all()


def test_zero_dim_is_an_error():
    with pytest.raises(ValueError, match="0-dim"):
        quantize_block_1d(torch.tensor(1.0))
