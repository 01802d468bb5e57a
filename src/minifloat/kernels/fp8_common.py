"""Device functions shared by the FP8 kernels: saturating RNE to FP8 bits, scales from amax,
an exactly rounded reciprocal, plus the host-side checks of which inputs the kernels serve.

Why integer rounding instead of `.to(tl.float8e4nv)`: Triton's interpreter converts to float8
with the wrong rounding, and hardware conversions differ in how they saturate. Rounding the fp32
bit pattern with integer arithmetic gives the bytes of numerics.formats.cast_to_fp8 (clamp to
+-max, round to nearest even on the format grid, subnormals included, NaN kept) on every backend.
On CUDA (sm_89+) the kernels take `cvt_sat_rne_fp8` instead: the hardware `cvt.rn.satfinite`
has exactly that contract apart from the NaN byte, which it fixes; the integer rounding costs
~25 integer ops an element, which held the cast kernels at 0.4 of copy bandwidth on an H100
(benchmarks/KERNEL_NOTES.md). Both paths are tested against the reference.

Why bit tests instead of float compares for special values: they cannot be affected by
flush-to-zero (a subnormal amax must not look like 0), and NaN ordering comes for free: with the
sign cleared, every NaN pattern is larger than +inf as an integer, so an integer max propagates
NaN exactly like torch.amax does.

Triton is imported under a guard: this module (and the kernel modules importing it) loads on a
machine without Triton; its kernels then refuse to launch with a clear error.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..numerics.formats import fp32_bits, fp32_round

try:  # guarded: minifloat must import without Triton (CPU-only installs)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None

KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# fp32 bit patterns of the largest finite FP8 values and their FP8 codes (sign bit clear).
E4M3_MAX_BITS = 0x43E00000  # 448.0
E4M3_MAX_CODE = 0x7E
E5M2_MAX_BITS = 0x47600000  # 57344.0
E5M2_MAX_CODE = 0x7B
FLT_MAX_BITS = 0x7F7FFFFF


def jit(fn: Any) -> Any:
    """triton.jit when Triton is installed; otherwise a stub that raises when launched."""
    if triton is not None:
        return triton.jit(fn)
    return _MissingTriton(fn.__name__)


class _MissingTriton:
    """Stands in for a kernel on machines without Triton (quantizers never reach it there)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: Any) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"kernel {self.name} needs Triton, which is not installed; use the numerics reference"
            " (minifloat.numerics) or install triton"
        )


def kernel_input(x: torch.Tensor, *state: torch.Tensor) -> bool:
    """Whether the FP8 kernels can read `x` as is: a non-empty contiguous fp32/bf16/fp16 tensor
    (plus fp32 state tensors, delayed-scaling scale and amax, on the same device)."""
    if x.dtype not in KERNEL_INPUT_DTYPES or x.numel() == 0 or not x.is_contiguous():
        return False
    return all(t.device == x.device and t.dtype == torch.float32 for t in state)


def is_e5m2(fp8_dtype: torch.dtype) -> bool:
    """The E5M2 constexpr flag of the kernels (E4M3 otherwise), with a clear error for others."""
    if fp8_dtype == torch.float8_e5m2:
        return True
    if fp8_dtype == torch.float8_e4m3fn:
        return False
    raise ValueError(
        f"unsupported FP8 dtype {fp8_dtype}: use torch.float8_e4m3fn or torch.float8_e5m2"
    )


@functools.lru_cache(maxsize=256)
def float32_bits(value: float) -> int:
    """The fp32 bit pattern of a Python float (rounded to fp32), as a signed int. Host-only
    integer rounding (numerics.formats.fp32_bits): no tensor built, no device read."""
    return fp32_bits(value)


@functools.lru_cache(maxsize=256)
def float32_value(value: float) -> float:
    """A Python float rounded to fp32 once on the host, so a kernel's fp32 argument is exact.
    Host-only integer rounding (numerics.formats.fp32_round): no tensor, no .item() per call."""
    return fp32_round(value)


def dtype_max_bits(dtype: torch.dtype) -> int:
    """fp32 bits of the input dtype's largest finite value (block-scale overflow value)."""
    return float32_bits(float(torch.finfo(dtype).max))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def max_programs(device: torch.device) -> int:
    """A cap on grid-stride programs: a few per SM on CUDA, a handful under the interpreter."""
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else 0)
    return 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# device functions
# ---------------------------------------------------------------------------------------------


@jit
def abs_bits(x):
    """|x| as int32 fp32 bits: ordered like the values, with every NaN above +inf."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@jit
def _sat_rne_bits(y, MANT_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
                  MAX_CODE: tl.constexpr):
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    is_nan = magnitude > 0x7F800000
    saturate = magnitude > MAX_BITS  # past max, infinities included: clamp to +-max
    exponent = magnitude >> 23  # biased fp32 exponent (0 for fp32 subnormals)
    significand = (magnitude & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    # |y| = significand * 2^(max(exponent, 1) - 150). In units of the format's quantum at that
    # magnitude (2^(e - MANT_BITS) for normals, 2^(1 - BIAS - MANT_BITS) below the smallest
    # normal) that is significand >> shift, shift = 23 - MANT_BITS for target-normal values and
    # larger for target-subnormal ones. Round it to nearest even with an integer add.
    MIN_NORMAL_EXPONENT: tl.constexpr = 128 - BIAS  # biased fp32 exponent of 2^(1 - BIAS)
    shift = (151 - BIAS - MANT_BITS) - tl.maximum(exponent, 1)
    shift = tl.minimum(tl.maximum(shift, 23 - MANT_BITS), 31)
    lsb = (significand >> shift) & 1
    units = (significand + ((1 << (shift - 1)) - 1) + lsb) >> shift
    # Normal target: code = (target exponent - 1) << MANT_BITS plus units, which include the
    # implicit bit (a rounding carry to 2^(MANT_BITS + 1) lands on the next exponent by itself).
    # Subnormal target: code = units (2^MANT_BITS is the smallest normal, the same code).
    normal = exponent >= MIN_NORMAL_EXPONENT
    offset = tl.where(normal, (exponent - MIN_NORMAL_EXPONENT) << MANT_BITS, 0)
    code = tl.where(saturate, MAX_CODE, units + offset)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@jit
def sat_rne_fp8(y, E5M2: tl.constexpr):
    """fp32 -> FP8 codes (uint8): round to nearest even, saturate to +-max, NaN -> 0x7F | sign.

    Same bytes as numerics.formats.cast_to_fp8 for every fp32 input, subnormals included.
    """
    if E5M2:
        code = _sat_rne_bits(y, 2, 15, 0x47600000, 0x7B)
    else:
        code = _sat_rne_bits(y, 3, 7, 0x43E00000, 0x7E)
    return code


@jit
def cvt_sat_rne_fp8(y, E5M2: tl.constexpr):
    """sat_rne_fp8 through the hardware conversion (sm_89+): `cvt.rn.satfinite` rounds to
    nearest even, keeps FP8 subnormals and clamps infinities and overflow to +-max, which is
    the contract; only NaN needs fixing (the hardware writes its canonical NaN, the contract
    0x7F | sign). Two elements per instruction, where the integer path takes ~25 integer ops
    per element (which bounds the cast kernels below copy bandwidth on an H100). CUDA only:
    the interpreter has no inline PTX (callers pass HW_CAST=False there)."""
    if E5M2:
        codes = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        codes = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
    return with_nan_codes(y, codes)


@jit
def with_nan_codes(x, codes):
    """`codes` with the contract's NaN byte (0x7F | the sign of x) wherever fp32 x is NaN.
    A cast of a product x * scale passes x itself: a GPU product of NaN is the canonical
    (positive) NaN, whatever x's sign."""
    bits = x.to(tl.int32, bitcast=True)
    nan_code = (((bits >> 24) & 0x80) | 0x7F).to(tl.uint8)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, nan_code, codes)


@jit
def fp8_codes(y, E5M2: tl.constexpr, HW_CAST: tl.constexpr):
    """FP8 codes of fp32 y (the sat_rne_fp8 contract): hardware conversion where HW_CAST (CUDA),
    integer rounding otherwise (the interpreter). Same bytes either way."""
    return cvt_sat_rne_fp8(y, E5M2) if HW_CAST else sat_rne_fp8(y, E5M2)


@jit
def scale_from_amax(amax, eps, E5M2: tl.constexpr, POW2: tl.constexpr,
                    OVERFLOW_BITS: tl.constexpr):
    """numerics.scale_from_amax on device: raise amax to eps; fp8_max / amax as ONE correctly
    rounded fp32 division (div_rn, not the approximate `/`); scale 1 for a zero, infinite or NaN
    amax; an infinite scale becomes the overflow value; power-of-2 scales clear the mantissa."""
    amax = tl.where(amax < eps, eps, amax)  # NaN compares false and stays NaN
    amax_mag = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    degenerate = (amax_mag == 0) | (amax_mag >= 0x7F800000)
    safe_amax = tl.where(degenerate, 1.0, amax)
    fp8_max = tl.zeros_like(safe_amax) + (57344.0 if E5M2 else 448.0)
    scale = tl.where(degenerate, 1.0, tl.math.div_rn(fp8_max, safe_amax))
    scale_bits = scale.to(tl.int32, bitcast=True)
    scale_bits = tl.where((scale_bits & 0x7FFFFFFF) == 0x7F800000, OVERFLOW_BITS, scale_bits)
    if POW2:
        scale_bits = scale_bits & -8388608  # 0xFF800000: keep sign and exponent (round down)
    return scale_bits.to(tl.float32, bitcast=True)


@jit
def reciprocal_rn(scale):
    """1 / scale correctly rounded, like torch.reciprocal, including subnormal results.

    div_rn gives the correctly rounded quotient, but a flush-to-zero build of it would return 0
    where the true result is subnormal (|scale| > 2^126, e.g. the FLT_MAX scale of a tiny amax).
    Those results are computed exactly in integers: 1/scale in units of 2^-149 is
    2^(299 - E) / significand, rounded to nearest even.
    """
    quotient = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    large = (exponent == 253) | (exponent == 254)
    significand = ((bits & 0x7FFFFF) | 0x800000).to(tl.int64)
    numerator = tl.full(significand.shape, 1, tl.int64) << tl.where(large, 299 - exponent, 45).to(
        tl.int64
    )
    units = numerator // significand
    remainder = numerator - units * significand
    round_up = (2 * remainder > significand) | ((2 * remainder == significand) & ((units & 1) == 1))
    exact_bits = (units + round_up.to(tl.int64)).to(tl.int32) | (bits & -2147483648)
    return tl.where(large, exact_bits.to(tl.float32, bitcast=True), quotient)


@jit
def tile_offsets(rows, cols, stride, WIDE: tl.constexpr):
    """rows[:, None] * stride + cols[None, :] for indices local to a tile.

    Addresses are a 64-bit tile base plus these offsets, so per-element math stays 32-bit (64-bit
    per-element addresses double the registers of the cast kernels); WIDE (set by the host when
    128 * max(M, K) reaches 2^31) switches to 64-bit offsets.
    """
    if WIDE:
        offsets = rows.to(tl.int64)[:, None] * stride + cols.to(tl.int64)[None, :]
    else:
        offsets = rows[:, None] * stride + cols[None, :]
    return offsets


@jit
def column_offsets(rows, cols, stride, WIDE: tl.constexpr):
    """rows[:, None] + cols[None, :] * stride: in-tile offsets of a transposed copy whose
    element (row, col) of the tile lands at col * stride + row (see tile_offsets for WIDE)."""
    if WIDE:
        offsets = rows.to(tl.int64)[:, None] + cols.to(tl.int64)[None, :] * stride
    else:
        offsets = rows[:, None] + cols[None, :] * stride
    return offsets


def hw_cast(x: torch.Tensor) -> bool:
    """Whether the kernels may use the hardware FP8 conversion for `x`: on CUDA (sm_89+, where
    cvt.rn.satfinite to e4m3/e5m2 exists), not under the interpreter. MINIFLOAT_INTEGER_CAST=1
    forces the integer rounding (for comparisons)."""
    if os.environ.get("MINIFLOAT_INTEGER_CAST", "0") == "1" or not x.is_cuda:
        return False
    return _capability(x.device.index if x.device.index is not None else 0) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def reads_halves(x: torch.Tensor, k: int) -> bool:
    """Whether a words tile (block_fp8.block_tile, per_tensor_tile) may read x as int64 words
    of four bf16 (HALVES): bf16, K % 4 == 0 (rows start on words) and 8-byte aligned."""
    return x.dtype == torch.bfloat16 and k % 4 == 0 and x.data_ptr() % 8 == 0


def max_u16x2(x: torch.Tensor) -> bool:
    """Whether the halfwise maxima may use max.u16x2 (sm_90+, hardware path)."""
    return hw_cast(x) and _capability(x.device.index or 0) >= (9, 0)


def needs_wide_offsets(m: int, k: int, tile: int = 128) -> bool:
    """Whether in-tile offsets (up to tile * max(M, K)) overflow int32."""
    return tile * max(m, k) + tile >= 2**31
