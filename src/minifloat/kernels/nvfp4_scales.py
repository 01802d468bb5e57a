"""NVFP4's scale and code rules in device code, shared by the element kernels (nvfp4.py,
nvfp4_multi.py, the master casts) and the 16x16 words kernel (nvfp4_words.py), so that each rule
is written once and every kernel writes the reference's bytes (NUMERICS.md §6).

- global_scales: S_enc = 2688 / amax and S_dec = 1 / S_enc, the reference's way;
- block_scales: the UE4M3 block scale codes and the fp32 element scales 1 / (s_b * S_dec);
- e2m1_magic_bits: round-to-nearest E2M1 codes without compares, as bits(2^23 + 8 + code)
  (nvfp4._e2m1_nibbles says why the min of three magic adds is exact).
"""

import struct

import triton
import triton.language as tl

from ..numerics.nvfp4 import GLOBAL_SCALE_NUMERATOR, ONE_SIXTH_FP32
from .element_cast import (
    E4M3_CONSTANTS,
    FP8_NAN_CODE,
    e4m3_code_to_float,
    is_nan_bits,
    magnitude_bits,
    round_to_code,
    split_magnitude,
)

UE4M3_MANTISSA, UE4M3_MIN_EXPONENT, UE4M3_MAX_CODE = (tl.constexpr(c) for c in E4M3_CONSTANTS)
GLOBAL_NUMERATOR = tl.constexpr(GLOBAL_SCALE_NUMERATOR)
ONE_SIXTH_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", ONE_SIXTH_FP32))[0])
FLT_MAX_BITS = tl.constexpr(0x7F7FFFFF)
# 2^23 + 8: fp32 values from 2^23 on are integers; the + 8 keeps a dithered sum z + d in
# (-1/2, 0) from falling below 2^23 (where halves exist), and leaves the code in the low 3 bits.
MAGIC = tl.constexpr(8388616.0)
MAGIC_SEVEN_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", 8388616.0 + 7.0))[0])


@triton.jit
def _flt_max_like(x):
    return tl.full(x.shape, FLT_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def cap_at_flt_max(x):
    """min(x, FLT_MAX) that keeps NaN (torch.clamp's rule; tl.minimum may drop NaN)."""
    return tl.where(x > _flt_max_like(x), _flt_max_like(x), x)


@triton.jit
def global_scales(amax_ptr):
    """(S_enc * fp32(1/6), S_dec) from the global amax A in device memory.

    S_enc = 2688 / A as one correctly rounded division (div_rn, not Triton's default division);
    1 when A is 0 or the quotient is 0; capped at FLT_MAX keeping NaN. S_dec = 1 / S_enc.
    """
    amax = tl.load(amax_ptr)
    s_enc = tl.div_rn(tl.full([], GLOBAL_NUMERATOR, tl.float32), amax)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_enc = cap_at_flt_max(s_enc)
    s_dec = tl.div_rn(tl.full([], 1.0, tl.float32), s_enc)
    one_sixth = tl.full([], ONE_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
    return s_enc * one_sixth, s_dec


@triton.jit
def block_scales(block_amax, factor, s_dec):
    """UE4M3 scale codes and fp32 element scales for block amaxes (any shape).

    s_b = ue4m3_sat_rne(min(block_amax * factor, FLT_MAX)); NaN gives the NaN code 0x7F.
    element scale = min(1 / (fp32(s_b) * S_dec), FLT_MAX), one correctly rounded division.
    """
    value = cap_at_flt_max(block_amax * factor)
    magnitude = magnitude_bits(value)
    mantissa, exponent = split_magnitude(magnitude)
    code = round_to_code(mantissa, exponent, UE4M3_MANTISSA, UE4M3_MIN_EXPONENT, UE4M3_MAX_CODE)
    code = tl.where(is_nan_bits(magnitude), FP8_NAN_CODE, code)
    decoded = e4m3_code_to_float(code)
    element_scale = tl.div_rn(tl.full(decoded.shape, 1.0, tl.float32), decoded * s_dec)
    return code, cap_at_flt_max(element_scale)


@triton.jit
def e2m1_magic_bits(a):
    """bits(2^23 + 8 + c) for the round-to-nearest E2M1 code c of a = |y| >= 0: the min of the
    three pieces 2a, a + 2, a / 2 + 4 (and 7), each rounded once by its add of MAGIC."""
    low = tl.fma(a, 2.0, MAGIC).to(tl.int32, bitcast=True)
    middle = (a + (MAGIC + 2.0)).to(tl.int32, bitcast=True)
    high = tl.fma(a, 0.5, MAGIC + 4.0).to(tl.int32, bitcast=True)
    return tl.minimum(tl.minimum(low, middle), tl.minimum(high, MAGIC_SEVEN_BITS))
