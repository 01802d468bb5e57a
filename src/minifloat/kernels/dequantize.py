"""One-pass decodes of MXFP8 and NVFP4 copies straight to bf16 GEMM operands (DESIGN.md §4).

The bf16 GEMM path multiplies decoded values in bf16 with fp32 accumulation. These kernels write
those operands in one pass, bit-equal to `numerics` dequantization followed by `.to(bfloat16)`,
with the reduction dim last and contiguous (the layout torch.mm reads directly):

- MXFP8 rowwise: data [M, K] (E4M3/E5M2), E8M0 scale [M, K/32] -> bf16 [M, K];
- MXFP8 columnwise: data [M, K], E8M0 scale [M/32, K] (blocks along M) -> bf16 [K, M], the
  transpose, through a tiled transpose of the FP8 bytes inside the kernel;
- NVFP4 blocks: packed E2M1 data [R, C/2] (element 2j in the low nibble), UE4M3 scale
  [R, C/16] -> bf16 [R, C] = q * s_b; the global decode scale stays the GEMM's alpha.

Exactness. The reference product q * 2^(e-127) is exact in fp32 (q has at most 4 significant
bits and its smallest step times the smallest E8M0 scale, 2^-143, is above fp32's 2^-149); the
only rounding is then the bf16 conversion, which is an exact identity unless the product is below
bf16's normal range (block scales below 2^-118). No float8 conversion is used (the interpreter
mis-rounds them): codes are decoded from their bits. A program whose block scales all lie in the
range where every product is a bf16 normal (E4M3_DECODE, E5M2_DECODE) takes a short path: the
code's bits placed in an fp32 (q * 2^(bias-127), exact, subnormal for subnormal codes) times the
normal factor 2^(e-bias), one exact fp32 multiply (Triton emits mul.rn.f32 without .ftz, so
subnormal operands are kept; the CUDA tests cover every code under every scale). Any other
program takes the general path, integer only: the exact fp32 bits of the product, then bf16
round-to-nearest-even on the bits, as torch rounds. NVFP4 products (E2M1 x UE4M3) are fp32
normals with at most 6 significant bits: exact fp32 multiplies of exactly decoded operands give
them, and the bf16 value is the top half of its bits. NaN comes out as the bf16 NaN 0x7FC0
(or the product's NaN for NVFP4); tests compare NaN positions, not payloads.

Measured on an H100 at 16384 x 8192 (benchmarks/dequantize_bench.py; a bf16 copy of the same
size runs at 2.95 TB/s): MXFP8 rowwise 0.186 ms (2.19 TB/s of bytes moved), columnwise
transposed 0.203 ms, NVFP4 0.135 ms (2.56 TB/s); the torch-op decode + cast it replaces took
1.69 / 2.08 / 3.89 ms.

Imported lazily by the quantizers' gemm_operand once `minifloat.kernels.available(data)` holds.
"""

import torch
import triton
import triton.language as tl

from ..numerics.mxfp8 import BLOCK as MX_BLOCK
from ..numerics.nvfp4 import BLOCK as NV_BLOCK
from .fp8_common import cdiv
from .launch import launch
from .nvfp4_scales import global_scales

# Tile shapes (elements), picked on an H100 at 16384 x 8192 (benchmarks/dequantize_bench.py):
# MXFP8 rowwise 16 x 256 codes, 8 warps; MXFP8 columnwise transposed 32 (along M) x 128 (along
# K) codes, 8 warps, each output row (one k) a 64-byte run of bf16; untransposed 32 x 128
# (the Linear step measured slower with the columnwise operands as .t() views of it, 11.6-12.0
# against 10.9-11.0 ms). NVFP4 (read as 8-byte words, one per 16-element block, since the
# eighteenth session): 32 rows x 256 packed bytes, 4 warps (sm_90 SASS: 10.6 instructions an
# element against 24 for the byte-wise kernel's 16 x 128 tiles; timed on the GPU in
# BENCHMARKS.md).
MX_ROW_BLOCK_M, MX_ROW_BLOCK_K, MX_ROW_WARPS = 16, 256, 8
MX_COL_BLOCK_M, MX_COL_BLOCK_K, MX_COL_WARPS = 32, 128, 8
MX_COLNT_BLOCK_M, MX_COLNT_BLOCK_K, MX_COLNT_WARPS = 32, 128, 8
NV_BLOCK_R, NV_BLOCK_BYTES, NV_WARPS = 32, 256, 4

BF16_NAN = tl.constexpr(0x7FC0)
BF16_INF = tl.constexpr(0x7F80)
FP32_INF_BITS = tl.constexpr(0x7F800000)
FP32_NAN_BITS = tl.constexpr(0x7FC00000)
TWO_TO_126 = tl.constexpr(2.0 ** 126)

# Per format: (MANTISSA_BITS, EXPONENT_BIAS, FAST_MIN_SCALE, FAST_MAX_SCALE). With every E8M0
# byte e of a program in [FAST_MIN_SCALE, FAST_MAX_SCALE], the short path is exact: its factor
# 2^(e - bias) is an fp32 normal (e - bias + 127 <= 254) and every product q * 2^(e-127) of a
# finite q is a bf16 normal or zero (the smallest step 2^(1 - bias - MANTISSA_BITS) times the
# scale stays >= 2^-126; the largest value times it stays < 2^128). Block scales above 2^7 (block
# amax above 57344 for E4M3) or below 2^-117 take the general path.
E4M3_DECODE = (3, 7, 10, 134)
E5M2_DECODE = (2, 15, 17, 142)
# fp32 masks (as int32) keeping the sign (bit 31) and the 7 magnitude bits of a sign-extended
# code shifted left by 23 - MANTISSA_BITS (its mantissa lands at the top of fp32's)
E4M3_FIELD_MASK = tl.constexpr(0x87F00000 - (1 << 32))
E5M2_FIELD_MASK = tl.constexpr(0x8FE00000 - (1 << 32))


@triton.jit
def _mx_fast(code, scale, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, E5M2: tl.constexpr):
    """bf16 bits (int32, the low half) of FP8 codes (sign-extended int8 as int32) times
    2^(e-127), e the E8M0 byte broadcast to them, for e in the format's fast range.

    The code's sign and magnitude bits moved into an fp32's sign, exponent and mantissa fields
    read as q * 2^(bias - 127) exactly, subnormal codes as fp32 subnormals of the same digits
    (fp32 multiplies run without flush-to-zero in Triton: no .ftz in the PTX). One fp32 multiply
    by the normal factor 2^(e - bias) gives the exact product, a bf16 normal: its top half."""
    if E5M2:
        bits = (code << (23 - MANTISSA_BITS)) & E5M2_FIELD_MASK
    else:
        bits = (code << (23 - MANTISSA_BITS)) & E4M3_FIELD_MASK
    factor = ((scale - BIAS + 127) << 23).to(tl.float32, bitcast=True)
    product = (bits.to(tl.float32, bitcast=True) * factor).to(tl.int32, bitcast=True) >> 16
    magnitude = code & 0x7F
    if E5M2:
        special = tl.where(magnitude == 0x7C, (product & 0x8000) | BF16_INF, BF16_NAN)
        return tl.where(magnitude >= 0x7C, special, product)
    else:
        return tl.where(magnitude == 0x7F, BF16_NAN, product)


@triton.jit
def _mx_general(code, scale, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr,
                E5M2: tl.constexpr):
    """bf16 bits (int32) of FP8 codes times 2^(e-127) for any E8M0 byte e (255 is NaN).

    q = M * 2^X with the integer M = implicit bit | mantissa (at most 4 bits) and
    X = max(E, 1) - bias - MANTISSA_BITS. The fp32 bits of M (an exact conversion) get the
    exponent delta X + e - 127 added; below fp32's normal range the significand is shifted right
    instead (exact: the product is a multiple of 2^-143); past it the result is infinity. bf16
    round-to-nearest-even on those bits then gives torch's `.to(bfloat16)` of the fp32 product.
    Codes may be sign-extended: only their low 8 bits are read."""
    magnitude = code & 0x7F
    exponent_field = magnitude >> MANTISSA_BITS
    mantissa = magnitude & ((1 << MANTISSA_BITS) - 1)
    significand = tl.where(exponent_field > 0, mantissa | (1 << MANTISSA_BITS), mantissa)
    delta = tl.maximum(exponent_field, 1) - BIAS - MANTISSA_BITS + scale - 127
    significand_bits = significand.to(tl.float32).to(tl.int32, bitcast=True)
    new_exponent = (significand_bits >> 23) + delta
    normal = significand_bits + (delta << 23)
    shift = tl.minimum(tl.maximum(1 - new_exponent, 0), 31)
    subnormal = ((significand_bits & 0x7FFFFF) | 0x800000) >> shift
    bits = tl.where(new_exponent >= 1, normal, subnormal)
    bits = tl.where(new_exponent >= 255, FP32_INF_BITS, bits)
    bf16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bf16 = tl.where(significand == 0, 0, bf16)
    if E5M2:
        bf16 = tl.where(magnitude == 0x7C, BF16_INF, bf16)
        special = (magnitude > 0x7C) | (scale == 255)
    else:
        special = (magnitude == 0x7F) | (scale == 255)
    bf16 = tl.where(special, BF16_NAN, bf16)
    return bf16 | ((code & 0x80) << 8)


@triton.jit
def _mx_decode(code, scale, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr,
               FAST_MIN: tl.constexpr, FAST_MAX: tl.constexpr, E5M2: tl.constexpr):
    """int16 bf16 bits of a tile of codes and their (broadcastable) E8M0 bytes: the short path
    when every scale of the tile is in the fast range, the general one otherwise."""
    if (tl.min(scale) >= FAST_MIN) & (tl.max(scale) <= FAST_MAX):
        bits = _mx_fast(code, scale, MANTISSA_BITS, BIAS, E5M2)
    else:
        bits = _mx_general(code, scale, MANTISSA_BITS, BIAS, E5M2)
    return bits.to(tl.int16)


@triton.jit
def _mxfp8_rowwise_kernel(
    data_ptr, scale_ptr, out_ptr, M, K,
    MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, FAST_MIN: tl.constexpr,
    FAST_MAX: tl.constexpr, E5M2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    """out[m, k] = bf16(q[m, k] * 2^(s[m, k // 32] - 127)); tiles [BLOCK_M, BLOCK_K] viewed as
    [BLOCK_M, BLOCK_K // 32, 32] so a block's scale broadcasts over its last axis."""
    row_start = tl.program_id(0) * BLOCK_M
    col_start = tl.program_id(1) * BLOCK_K
    NB: tl.constexpr = BLOCK_K // SCALE_BLOCK
    rows = tl.arange(0, BLOCK_M)[:, None, None]
    blocks = tl.arange(0, NB)[None, :, None]
    lanes = tl.arange(0, SCALE_BLOCK)[None, None, :]
    cols = blocks * SCALE_BLOCK + lanes
    mask = ((row_start + rows) < M) & ((col_start + cols) < K)  # K % 32 == 0: whole blocks
    origin = row_start.to(tl.int64) * K + col_start
    offsets = rows * K + cols
    code = tl.load(data_ptr + origin + offsets, mask=mask, other=0).to(tl.int32)
    scale_cols = K // SCALE_BLOCK
    scale_mask = ((row_start + rows) < M) & ((col_start // SCALE_BLOCK + blocks) < scale_cols)
    scale_origin = row_start.to(tl.int64) * scale_cols + col_start // SCALE_BLOCK
    scale = tl.load(scale_ptr + scale_origin + rows * scale_cols + blocks, mask=scale_mask,
                    other=127).to(tl.int32)
    bits = _mx_decode(code, scale, MANTISSA_BITS, BIAS, FAST_MIN, FAST_MAX, E5M2)
    tl.store(out_ptr + origin + offsets, bits, mask=mask)


@triton.jit
def _mxfp8_columnwise_kernel(
    data_ptr, scale_ptr, out_ptr, M, K,
    MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, FAST_MIN: tl.constexpr,
    FAST_MAX: tl.constexpr, E5M2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    """bf16(q[m, k] * 2^(s[m // 32, k] - 127)) into out[k, m] (out [K, M] contiguous) when
    TRANSPOSE, else into out[m, k].

    The codes of a [BLOCK_M, BLOCK_K] tile load along K (coalesced), viewed as
    [BLOCK_M // 32, 32, BLOCK_K]. To transpose, the byte tile is permuted to
    [BLOCK_K, BLOCK_M // 32, 32] (one byte an element through shared memory), decoded in the
    output's layout and stored along M."""
    row_start = tl.program_id(0) * BLOCK_M  # along M
    col_start = tl.program_id(1) * BLOCK_K  # along K
    NB: tl.constexpr = BLOCK_M // SCALE_BLOCK
    blocks = tl.arange(0, NB)[:, None, None]
    lanes = tl.arange(0, SCALE_BLOCK)[None, :, None]
    cols = tl.arange(0, BLOCK_K)[None, None, :]
    rows = blocks * SCALE_BLOCK + lanes
    mask = ((row_start + rows) < M) & ((col_start + cols) < K)
    origin = row_start.to(tl.int64) * K + col_start
    code = tl.load(data_ptr + origin + rows * K + cols, mask=mask, other=0)
    scale_origin = (row_start // SCALE_BLOCK).to(tl.int64) * K + col_start
    if TRANSPOSE:
        code = tl.permute(code, (2, 0, 1)).to(tl.int32)  # [BLOCK_K, NB, 32]
        k_idx = tl.arange(0, BLOCK_K)[:, None, None]
        b_idx = tl.arange(0, NB)[None, :, None]
        l_idx = tl.arange(0, SCALE_BLOCK)[None, None, :]
        scale_mask = ((row_start // SCALE_BLOCK + b_idx) < M // SCALE_BLOCK) & (
            (col_start + k_idx) < K)
        scale = tl.load(scale_ptr + scale_origin + b_idx * K + k_idx, mask=scale_mask,
                        other=127).to(tl.int32)  # [BLOCK_K, NB, 1]
        bits = _mx_decode(code, scale, MANTISSA_BITS, BIAS, FAST_MIN, FAST_MAX, E5M2)
        m_idx = b_idx * SCALE_BLOCK + l_idx
        out_mask = ((row_start + m_idx) < M) & ((col_start + k_idx) < K)
        out_origin = col_start.to(tl.int64) * M + row_start
        tl.store(out_ptr + out_origin + k_idx * M + m_idx, bits, mask=out_mask)
    else:
        scale_mask = ((row_start // SCALE_BLOCK + blocks) < M // SCALE_BLOCK) & (
            (col_start + cols) < K)
        scale = tl.load(scale_ptr + scale_origin + blocks * K + cols, mask=scale_mask,
                        other=127).to(tl.int32)  # [NB, 1, BLOCK_K]
        bits = _mx_decode(code.to(tl.int32), scale, MANTISSA_BITS, BIAS, FAST_MIN, FAST_MAX,
                          E5M2)
        tl.store(out_ptr + origin + rows * K + cols, bits, mask=mask)


@triton.jit
def _e2m1_raw(part, SHIFT: tl.constexpr):
    """fp32 bits of E2M1 code c = nibble (part >> SHIFT) & 0xF times 2^-126 (exact): the
    magnitude bits placed at fp32 bits 22-24 make exponent field c >> 1 and top mantissa bit
    c & 1, a normal (1 + m / 2) 2^(e - 127) for e >= 1 and the subnormal m 2^-127 for e = 0,
    which is E2M1's own rule shifted by 2^-126; bit 3 of the nibble is the sign."""
    # SHIFT is a constexpr multiple of 4 up to 28: the sign (bit SHIFT + 3) always moves left
    magnitude = (((part >> (SHIFT - 22)) if SHIFT >= 22 else (part << (22 - SHIFT)))
                 & 0x01C00000)
    sign = (part << (28 - SHIFT)) & -2147483648
    return (magnitude | sign).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_block_words(packed, s_value):
    """The eight int32 words of bf16 pairs (element 2 i in the low half of word i) of the 16
    elements one int64 word of packed nibbles holds (element 2 j in the low nibble of byte j),
    each q * s_value: two exact fp32 products, (q 2^-126) 2^126 (the subnormal operand is kept:
    Triton's mul.f32 does not flush) and then times the block scale, whose top half is the bf16
    value (q s has at most 6 significant bits)."""
    words = ()
    for half in tl.static_range(2):
        part = (packed >> (32 * half)).to(tl.int32)
        for byte in tl.static_range(4):
            low = ((_e2m1_raw(part, 8 * byte) * TWO_TO_126) * s_value).to(tl.int32,
                                                                         bitcast=True)
            high = ((_e2m1_raw(part, 8 * byte + 4) * TWO_TO_126) * s_value).to(tl.int32,
                                                                              bitcast=True)
            words = words + (((low >> 16) & 0xFFFF) | (high & -65536),)
    return words


@triton.jit
def _nvfp4_kernel(
    data_ptr, scale_ptr, out_ptr, amax_ptr, s_dec_ptr, R, C_WORDS,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, DECODE_SCALE: tl.constexpr,
):
    """out[r, 16 w + e] = bf16 of element e of block w of row r times fp32(s[r, w]). data_ptr:
    the packed data as int64 [R, C_WORDS], one word per 16-element block (its 8 bytes), so the
    block's scale is one byte per word and every step is elementwise over [BLOCK_R, BLOCK_W]
    (byte-wise tiles took ~24 SASS instructions an element on sm_90, with byte loads; ~10
    this way); out_ptr: the bf16 output as int32 [R, 8 C_WORDS], eight words per block, stored
    as 32 contiguous bytes. DECODE_SCALE: program (0, 0) also writes S_dec of the global amax,
    the GEMM's factor (the reference's rule, nvfp4_scales.global_scales)."""
    if DECODE_SCALE:  # noqa: SIM102 (a constexpr branch: compiled out where False)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _, s_dec = global_scales(amax_ptr)
            tl.store(s_dec_ptr, s_dec)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    blocks = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    mask = (rows < R) & (blocks < C_WORDS)
    offsets = rows.to(tl.int64) * C_WORDS + blocks
    packed = tl.load(data_ptr + offsets, mask=mask, other=0)
    s = tl.load(scale_ptr + offsets, mask=mask, other=0x38).to(tl.int32)
    # UE4M3 byte -> fp32 (exact; subnormals m * 2^-9 through a normal multiply; 0x7F is NaN)
    magnitude = s & 0x7F
    exponent_field = magnitude >> 3
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = (magnitude & 7).to(tl.float32) * 0.001953125
    s_value = tl.where(exponent_field == 0, subnormal, normal)
    nan = tl.full(s_value.shape, FP32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    s_value = tl.where(magnitude == 0x7F, nan, s_value)
    # the sign by its bit (negation is 0 - x in Triton, which loses -0)
    s_value = (s_value.to(tl.int32, bitcast=True) | ((s & 0x80) << 24)).to(tl.float32,
                                                                            bitcast=True)
    w = _nvfp4_block_words(packed, s_value)
    # [BLOCK_R, BLOCK_W, 8] in element order: join(a, b)[..., k] is a for k = 0, b for k = 1,
    # so the innermost join pairs words 4 apart and the outermost words 1 apart
    out = tl.join(tl.join(tl.join(w[0], w[4]), tl.join(w[2], w[6])),
                  tl.join(tl.join(w[1], w[5]), tl.join(w[3], w[7])))
    out = tl.reshape(out, [BLOCK_R, BLOCK_W, 8])
    out_offsets = (8 * offsets)[:, :, None] + tl.arange(0, 8)[None, None, :]
    tl.store(out_ptr + out_offsets, out, mask=tl.broadcast_to(mask[:, :, None], out.shape))


def _mx_constants(data: torch.Tensor) -> dict:
    if data.dtype == torch.float8_e4m3fn:
        mantissa_bits, bias, fast_min, fast_max = E4M3_DECODE
    elif data.dtype == torch.float8_e5m2:
        mantissa_bits, bias, fast_min, fast_max = E5M2_DECODE
    else:
        raise ValueError(f"MXFP8 data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    return dict(MANTISSA_BITS=mantissa_bits, BIAS=bias, FAST_MIN=fast_min, FAST_MAX=fast_max,
                E5M2=data.dtype == torch.float8_e5m2)


def _check_out(out: torch.Tensor | None, shape: tuple, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out


def dequantize_mxfp8_bf16(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    columnwise: bool = False,
    transpose: bool = True,
    out: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The GEMM operand of an MXFP8 copy in bf16, equal to
    `numerics.dequantize_mxfp8(data, scale, columnwise=...).to(bfloat16)` (transposed for
    columnwise), reduction dim last and contiguous:

    - rowwise: data [..., K], scale [..., K/32] -> bf16 of data's shape;
    - columnwise: data [M, K] (leading dims flattened), scale [M/32, K] -> bf16 [K, M]
      (with transpose=False: bf16 [M, K], whose .t() is the operand as a view).

    `out` (optional) receives the result; `block_shape` overrides the tile (benchmarks).
    """
    constants = _mx_constants(data)
    k = data.shape[-1] if data.dim() else 0
    data2d = data.reshape(-1, k).contiguous().view(torch.int8)  # codes sign-extend in-kernel
    m = data2d.shape[0]
    if k % MX_BLOCK or (columnwise and m % MX_BLOCK):
        raise ValueError(f"MXFP8 data {tuple(data.shape)}: blocks of {MX_BLOCK} must tile it")
    scale2d = scale.contiguous().view(torch.uint8).reshape(
        (m // MX_BLOCK, k) if columnwise else (m, k // MX_BLOCK))
    tile_k = block_shape[1] if block_shape else MX_COL_BLOCK_K
    if columnwise and transpose and tile_k * m >= 2**31:
        # the transposed stores offset rows of the output tile by k * M in int32: past 2^31,
        # decode untransposed and let torch transpose (never reached below ~16M rows)
        flat = dequantize_mxfp8_bf16(data, scale, columnwise=True, transpose=False)
        result = _check_out(out, (k, m), data.device)
        return result.copy_(flat.t())
    if columnwise:
        result = _check_out(out, (k, m) if transpose else (m, k), data.device)
        if transpose:
            block_m, block_k = block_shape or (MX_COL_BLOCK_M, MX_COL_BLOCK_K)
            warps = MX_COL_WARPS
        else:
            block_m, block_k = block_shape or (MX_COLNT_BLOCK_M, MX_COLNT_BLOCK_K)
            warps = MX_COLNT_WARPS
        kernel = _mxfp8_columnwise_kernel
        constants["TRANSPOSE"] = transpose
    else:
        result = _check_out(out, tuple(data.shape), data.device)
        block_m, block_k = block_shape or (MX_ROW_BLOCK_M, MX_ROW_BLOCK_K)
        kernel, warps = _mxfp8_rowwise_kernel, MX_ROW_WARPS
    if (block_m if columnwise else block_k) % MX_BLOCK:
        raise ValueError(f"block_shape {(block_m, block_k)} must hold whole {MX_BLOCK}-blocks")
    if m * k:
        grid = (cdiv(m, block_m), cdiv(k, block_k))
        launch(
            kernel, grid, data2d, scale2d, result.view(torch.int16), m, k, **constants,
            BLOCK_M=block_m, BLOCK_K=block_k, SCALE_BLOCK=MX_BLOCK, num_warps=warps,
        )
    return result


def dequantize_nvfp4_blocks_bf16(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """q * fp32(s_b) in bf16, equal to `numerics.dequantize_nvfp4_blocks(data, scale)
    .to(bfloat16)`: packed E2M1 data [..., C/2] (uint8), UE4M3 scale [..., C/16] (float8_e4m3fn
    or its bytes) -> bf16 [..., C], contiguous. `out` (optional) receives the result;
    `block_shape` (rows, packed bytes) overrides the tile (benchmarks)."""
    return _decode_nvfp4(data, scale, None, out, block_shape)[0]


def dequantize_nvfp4_operand(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An NVFP4 copy as a GEMM operand: (dequantize_nvfp4_blocks_bf16's values, S_dec of the
    global amax), the pair `numerics` gives as (dequantize_nvfp4_blocks, global_decode_scale),
    in one launch. Computed as torch ops, S_dec took five tiny kernels an operand (a division,
    two compares, a select, a clamp, a reciprocal): about half the kernels of an NVFP4 step."""
    return _decode_nvfp4(data, scale, amax, None, None)


def _decode_nvfp4(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None,
    out: torch.Tensor | None, block_shape: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one launch behind both entries: the bf16 values, and S_dec where `amax` is given
    (the launch then runs even for an empty copy, whose S_dec the GEMM still multiplies)."""
    c_bytes = data.shape[-1] if data.dim() else 0
    data2d = data.reshape(-1, c_bytes).contiguous().view(torch.uint8)
    rows = data2d.shape[0]
    block_bytes = NV_BLOCK // 2
    if c_bytes % block_bytes:
        raise ValueError(f"NVFP4 data {tuple(data.shape)}: blocks of {NV_BLOCK} must tile it")
    scale2d = scale.contiguous().view(torch.uint8).reshape(rows, c_bytes // block_bytes)
    result = _check_out(out, (*data.shape[:-1], 2 * c_bytes), data.device)
    block_r, block_c = block_shape or (NV_BLOCK_R, NV_BLOCK_BYTES)
    if block_c % block_bytes:
        raise ValueError(f"block_shape {(block_r, block_c)} must hold whole {NV_BLOCK}-blocks")
    s_dec = None
    if amax is not None:
        if amax.numel() != 1:
            raise ValueError(f"NVFP4's global amax must be one value, got {amax.numel()}")
        amax = amax.float()  # as numerics.global_encode_scale reads it (no copy when fp32)
        s_dec = torch.empty_like(amax)
    if data2d.data_ptr() % 8:  # a view at an odd offset: the kernel reads 8-byte words
        data2d = data2d.clone()
    c_words, block_w = c_bytes // block_bytes, block_c // block_bytes  # one word per block
    grid = (max(cdiv(rows, block_r), 1), max(cdiv(c_words, block_w), 1))
    if rows * c_bytes or s_dec is not None:
        launch(
            _nvfp4_kernel, grid, data2d.view(torch.int64), scale2d, result.view(torch.int32),
            result if amax is None else amax, result if s_dec is None else s_dec, rows, c_words,
            BLOCK_R=block_r, BLOCK_W=block_w, DECODE_SCALE=amax is not None,
            num_warps=NV_WARPS,
        )
    return result, s_dec
