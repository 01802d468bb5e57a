"""Bit-exact element casts for Triton kernels: E4M3, E5M2, E2M1, UE4M3, E8M0 and bf16.

Why integer arithmetic on fp32 bit patterns instead of `.to(tl.float8e4nv)`: the kernels must
reproduce minifloat.numerics bit for bit (NUMERICS.md §1), and Triton's own conversions are not
held to that (the interpreter rounds some values to the wrong neighbour; saturation and NaN
handling of the hardware conversions vary with the target and Triton version). Working on bits
also keeps every step exact for fp32 subnormals, whatever a device does with denormal operands,
and runs the same under the interpreter and on the GPU.

A format is described by three constexprs: MANTISSA_BITS, MIN_EXPONENT (unbiased exponent of the
smallest normal, which subnormals share as their quantum's base) and MAX_CODE (the magnitude code
of the largest finite value). Codes are magnitudes only; callers add the sign bit.

This module imports triton at the top: it is imported only from kernel modules, which the
quantizers import lazily once `minifloat.kernels.available(x)` said yes.
"""

import torch
import triton
import triton.language as tl

from ..numerics.formats import E2M1, E4M3, E5M2, ElementFormat


def format_constants(fmt: ElementFormat) -> tuple[int, int, int]:
    """(MANTISSA_BITS, MIN_EXPONENT, MAX_CODE) of an element format, for the kernels below."""
    max_exponent = 0
    while 2.0 ** (max_exponent + 1) <= fmt.max_value:
        max_exponent += 1
    fraction = fmt.max_value / 2.0**max_exponent - 1.0
    max_code = ((max_exponent + fmt.bias) << fmt.mantissa_bits) + round(
        fraction * 2**fmt.mantissa_bits
    )
    return fmt.mantissa_bits, fmt.min_normal_exponent, max_code


E4M3_CONSTANTS = format_constants(E4M3)  # (3, -6, 0x7E)
E5M2_CONSTANTS = format_constants(E5M2)  # (2, -14, 0x7B)
E2M1_CONSTANTS = format_constants(E2M1)  # (1, 0, 7)
# Globals read inside @triton.jit functions must be constexprs.
FP8_NAN_CODE = tl.constexpr(0x7F)  # E4M3/E5M2 NaN as torch encodes a positive NaN (+0x80 sign)
FP32_INF_BITS = tl.constexpr(0x7F800000)
FP32_NAN_BITS = tl.constexpr(0x7FC00000)


def kernel_view(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor the kernel reads, whether it holds bf16 bit patterns as int16).

    bf16 inputs travel as int16 and widen by a shift (load_as_float): exact for every value,
    where a conversion may flush bf16 subnormals (Triton's interpreter does).
    """
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    return x, False


@triton.jit
def load_as_float(ptr, offsets, mask, BF16_BITS: tl.constexpr):
    """Load fp32/fp16 values (converted exactly) or bf16 bit patterns (int16) as fp32; masked
    elements read as 0. mask=None (a compile-time case): every element, with no mask, so the
    loads may be vectors (tl.load refuses `other` without a mask)."""
    if mask is None:
        values = tl.load(ptr + offsets)
    elif BF16_BITS:
        values = tl.load(ptr + offsets, mask=mask, other=0)
    else:
        values = tl.load(ptr + offsets, mask=mask, other=0.0)
    if BF16_BITS:
        bits = values.to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    return values.to(tl.float32)


@triton.jit
def magnitude_bits(x):
    """|x| of fp32 values as int32 bits. Their integer order is the float order, with NaN above
    inf, so an integer max over them is a NaN-propagating absolute max (torch.amax's rule)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def sign_bit(x):
    """1 where the fp32 sign bit is set (negative values, -0, negative NaN), else 0."""
    return (x.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def is_nan_bits(magnitude):
    return magnitude > FP32_INF_BITS


@triton.jit
def split_magnitude(magnitude):
    """Exact (mantissa, exponent) of fp32 magnitude bits: value = mantissa * 2^(exponent - 23),
    mantissa in [2^23, 2^24).

    Subnormals are normalised through an int -> fp32 conversion of their fraction (exact below
    2^24), so no float arithmetic touches a denormal. Zero comes out as 2^-276, far below half of
    any format's smallest step: it rounds to zero. Infinity comes out as 2^128 (saturates).
    """
    exponent_field = magnitude >> 23
    fraction = magnitude & 0x7FFFFF
    normalised = fraction.to(tl.float32).to(tl.int32, bitcast=True)
    subnormal = exponent_field == 0
    mantissa = tl.where(subnormal, normalised & 0x7FFFFF, fraction) | 0x800000
    exponent = tl.where(subnormal, (normalised >> 23) - 276, exponent_field - 127)
    return mantissa, exponent


@triton.jit
def round_to_code(
    mantissa,
    exponent,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    """Magnitude code of mantissa * 2^(exponent - 23) rounded to nearest, ties to even, and
    saturated (numerics.formats.round_to_format, then the format's encoding).

    The quantum is 2^(max(exponent, MIN_EXPONENT) - MANTISSA_BITS); the kept units are the
    mantissa shifted right by the distance to it. Code = (region << MANTISSA_BITS) + units, which
    carries into the exponent when rounding up crosses a power of two and covers subnormals
    (region 0). Rounding is monotone and the format's max is on the grid, so clamping the code
    afterwards equals the reference's clamp of the value before rounding.
    """
    region = tl.maximum(exponent, MIN_EXPONENT)
    # shift >= 23 - MANTISSA_BITS; past 25 every mantissa (< 2^24) is below half a quantum.
    shift = tl.minimum(region - MANTISSA_BITS - exponent + 23, 25)
    units = mantissa >> shift
    remainder = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((units & 1) == 1))
    code = ((region - MIN_EXPONENT) << MANTISSA_BITS) + units + round_up.to(tl.int32)
    return tl.minimum(code, MAX_CODE)


@triton.jit
def round_to_bf16(x):
    """fp32 values rounded to bf16 (nearest, ties to even), returned as fp32. Infinities and
    overflow to infinity come out of the carry; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(is_nan_bits(bits & 0x7FFFFFFF), x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def e4m3_code_to_float(code):
    """fp32 value of E4M3 codes 0..0x7F (positive; 0x7F is NaN), built from bits (exact)."""
    exponent_field = code >> 3
    mantissa = code & 7
    normal = (((exponent_field + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9, exact
    value = tl.where(exponent_field == 0, subnormal, normal)
    nan = tl.full(code.shape, FP32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(code == FP8_NAN_CODE, nan, value)


@triton.jit
def e8m0_exponent(block_amax, RECIPROCAL_BITS: tl.constexpr):
    """Biased E8M0 exponent (int32) of round_up_pow2(block_amax * R), R = fp32(1/element_max)
    given by its bits (NUMERICS.md §5; numerics.mxfp8.e8m0_exponent)."""
    reciprocal = tl.full(block_amax.shape, RECIPROCAL_BITS, tl.int32).to(tl.float32, bitcast=True)
    v = block_amax * reciprocal
    bits = v.to(tl.int32, bitcast=True)
    exponent_field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent_field != 0xFE)
    round_up = round_up & ~((exponent_field == 0) & (mantissa <= 0x400000))
    e = exponent_field + round_up.to(tl.int32)
    magnitude = bits & 0x7FFFFFFF
    e = tl.where(magnitude == FP32_INF_BITS, 0xFE, e)
    e = tl.where(magnitude > FP32_INF_BITS, 0xFF, e)
    return tl.where(magnitude == 0, 0, e)


@triton.jit
def pack_nibbles(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] int32 nibble codes -> [ROWS, COLS // 2] uint8, element 2j in the low nibble."""
    low, high = tl.split(tl.reshape(codes, [ROWS, COLS // 2, 2]))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def expand_blocks(values, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Per-block values [ROWS, COLS // BLOCK] repeated over their BLOCK elements -> [ROWS, COLS]."""
    repeated = tl.broadcast_to(values[:, :, None], [ROWS, COLS // BLOCK, BLOCK])
    return tl.reshape(repeated, [ROWS, COLS])
