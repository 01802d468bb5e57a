"""Element formats and their casts: E4M3, E5M2, E2M1, E8M0 and UE4M3 (NUMERICS.md §1, §7).

Every cast here rounds on the fp32 grid by explicit arithmetic (scale to integer units of the
format's quantum, round, scale back), so the reference does not depend on how a given torch build
converts to float8. Tests compare this against torch's own conversion of clamped inputs, which is
an independent implementation of the same rounding.

Rounding is round-to-nearest-even (or stochastic), and saturating: anything past the format's
largest finite value, infinities included, becomes +-max. NaN stays NaN where the format has one.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

FLT_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude minifloat: exponent bits, mantissa bits, bias and largest finite value."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float
    torch_dtype: torch.dtype | None  # storage dtype; None for E2M1 (packed in uint8 nibbles)

    @property
    def min_normal_exponent(self) -> int:
        """Unbiased exponent of the smallest normal number; subnormals share its quantum."""
        return 1 - self.bias


E4M3 = ElementFormat("E4M3", 4, 3, 7, 448.0, torch.float8_e4m3fn)
E5M2 = ElementFormat("E5M2", 5, 2, 15, 57344.0, torch.float8_e5m2)
E2M1 = ElementFormat("E2M1", 2, 1, 1, 6.0, None)
# UE4M3 (NVFP4 block scales) is E4M3 used for positive values only: same grid, same bytes.
UE4M3 = E4M3

FP8_FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def fp8_format(dtype: torch.dtype) -> ElementFormat:
    """The ElementFormat of an FP8 torch dtype, with a clear error for anything else."""
    try:
        return FP8_FORMATS[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported FP8 dtype {dtype}: use torch.float8_e4m3fn or torch.float8_e5m2"
        ) from None


def exp2_exact(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32 for integer exponents in [-149, 127], built from the bit pattern.

    Normal results set the exponent field; results below 2^-126 are subnormals with a single
    mantissa bit. No arithmetic is involved, so the value is exact on every device.
    """
    exponent = exponent.to(torch.int32)
    normal_bits = (exponent + 127) << 23
    subnormal_bits = torch.ones_like(exponent) << torch.clamp(exponent + 149, 0, 22)
    bits = torch.where(exponent >= -126, normal_bits, subnormal_bits)
    return bits.view(torch.float32)


def _quantum(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Spacing of the format's grid around |x| (fp32 power of two, exact).

    For a normal number with unbiased exponent e the spacing is 2^(e - mantissa_bits); below the
    smallest normal exponent the subnormal spacing 2^(min_normal_exponent - mantissa_bits) holds.
    """
    _, exponent = torch.frexp(x)  # x = m * 2^exponent with 0.5 <= |m| < 1, so e = exponent - 1
    unbiased = torch.clamp(exponent - 1, min=fmt.min_normal_exponent)
    return exp2_exact(unbiased - fmt.mantissa_bits)


def round_to_format(
    x: torch.Tensor,
    fmt: ElementFormat,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round fp32 values onto the format's grid and saturate; returns fp32 values on the grid.

    RNE: clamp to +-max first (a value <= max never rounds above max because max is on the grid),
    then round(x / quantum) with ties to even. Division by a power of two is exact in fp32.
    Stochastic: floor(x / quantum) + 1 with probability equal to the fractional part, drawn from
    `generator` (torch's default generator when None).
    """
    x = x.float()
    clamped = torch.clamp(x, -fmt.max_value, fmt.max_value)  # NaN propagates, inf saturates
    quantum = _quantum(clamped, fmt)
    units = clamped / quantum
    if stochastic:
        lower = torch.floor(units)
        draw = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        rounded = lower + (draw < (units - lower)).float()
        # floor() loses the sign of zero for small negatives; restore it so -0 encodes as -0.
        rounded = torch.copysign(rounded, clamped)
    else:
        rounded = torch.round(units)  # round half to even
    return rounded * quantum


def cast_to_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Saturating cast of fp32 values to an FP8 dtype (E4M3 or E5M2).

    The rounding happens in round_to_format; the final `.to(dtype)` only encodes values that are
    already on the grid, which any correct conversion does exactly.
    """
    fmt = fp8_format(dtype)
    return round_to_format(x, fmt, stochastic=stochastic, generator=generator).to(dtype)


# ---- E2M1 (FP4): packed two per byte, element 2j in the low nibble ----

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Encode fp32 values already on the E2M1 grid into 4-bit codes (uint8, one per element).

    NaN encodes as +0: E2M1 has no NaN, so NaN is carried by the block scale (NUMERICS.md §1).
    """
    values = torch.nan_to_num(values, nan=0.0)
    magnitude = values.abs()
    code = torch.where(
        magnitude < 2.0,
        magnitude * 2.0,  # 0, 0.5, 1, 1.5 -> 0..3
        # 2, 3 -> codes 4, 5; 4, 6 -> codes 6, 7
        torch.where(magnitude < 4.0, magnitude + 2.0, magnitude * 0.5 + 4.0),
    ).to(torch.uint8)
    sign = torch.signbit(values).to(torch.uint8) << 3
    return code | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) to fp32 values (E2M1_VALUES), from the code's exponent bits e and
    mantissa bit m: m / 2 when e = 0, else 2^(e-1) (1 + m / 2). Arithmetic, not a value
    table: a table built per call is a host-to-device copy, which makes the caller wait for
    the GPU (a compiled graph or CUDA graph cannot hold it either)."""
    exponent = ((codes >> 1) & 0x3).to(torch.int32)
    mantissa = (codes & 0x1).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa * 0.5,
                            torch.ldexp(1.0 + mantissa * 0.5, exponent - 1))
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2j in the low nibble, 2j+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 elements ({codes.shape[-1]})")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (inverse of pack_nibbles)."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)


def cast_to_e2m1(
    x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Saturating cast of fp32 values to packed E2M1 (uint8, last dim halved)."""
    rounded = round_to_format(x, E2M1, stochastic=stochastic, generator=generator)
    return pack_nibbles(encode_e2m1(rounded))


def e2m1_to_float(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes to fp32 values (last dim doubled)."""
    return decode_e2m1(unpack_nibbles(packed))


# ---- E8M0: a bare biased exponent, value 2^(b - 127), b = 255 is NaN ----

E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) to their fp32 values 2^(b-127); 255 decodes to NaN."""
    biased = biased.to(torch.int32)
    value = exp2_exact(biased - E8M0_BIAS)
    return torch.where(biased == E8M0_NAN, torch.full_like(value, float("nan")), value)


def fp32_divide(numerator: float | torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator as one correctly rounded fp32 division.

    `python_float / tensor` is not that: torch evaluates it as reciprocal(tensor) * float, two
    roundings, which changes scales (448 / 3 gives 0x43155556 instead of 0x43155555).
    """
    denominator = denominator.float()
    if not isinstance(numerator, torch.Tensor):
        numerator = torch.full_like(denominator, numerator)
    return torch.div(numerator.float(), denominator)


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern of fp32 values as int32 (a view, no conversion)."""
    return x.float().contiguous().view(torch.int32)


def clear_mantissa(x: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 values down to a power of two by clearing the 23 mantissa bits."""
    return (float_bits(x) & ~0x7FFFFF).view(torch.float32)


# ---- fp32 rounding of host (Python) numbers ----


def _fp32_round(value: float) -> tuple[float, int]:
    """(value rounded to fp32, its unsigned bit pattern): round to nearest, ties to even,
    overflow to +-inf, subnormals kept, exactly as an IEEE double -> float cast rounds."""
    if math.isnan(value):  # the C cast's NaN (sign and quiet bit kept): what torch stores
        return value, struct.unpack("<I", struct.pack("<f", value))[0]
    sign = 0x80000000 if math.copysign(1.0, value) < 0 else 0
    magnitude = abs(value)
    if magnitude == 0.0 or math.isinf(magnitude):
        return value, sign | (0x7F800000 if magnitude else 0)
    _, exponent = math.frexp(magnitude)  # 2^(exponent - 1) <= magnitude < 2^exponent
    shift = max(exponent - 24, -149)  # the fp32 quantum here: 24 significant bits, or 2^-149
    numerator, denominator = magnitude.as_integer_ratio()  # exact (denominator a power of two)
    if shift >= 0:
        denominator <<= shift
    else:
        numerator <<= -shift
    units, remainder = divmod(numerator, denominator)  # magnitude / 2^shift = units + r / d
    if 2 * remainder > denominator or (2 * remainder == denominator and units & 1):
        units += 1
    if units == 1 << 24:  # rounded up to the next power of two
        units, shift = 1 << 23, shift + 1
    biased = shift + 150 if units >= 1 << 23 else 0  # units < 2^23 only below 2^-126
    if biased >= 255:
        return math.copysign(math.inf, value), sign | 0x7F800000
    bits = (biased << 23) | (units & 0x7FFFFF) if biased else units
    return math.copysign(math.ldexp(units, shift), value), sign | bits


def fp32_round(value: float) -> float:
    """A Python float rounded to the nearest fp32 value (what `torch.tensor(value,
    dtype=torch.float32).item()` gives), computed in exact integer arithmetic on the host.

    Why: kernel arguments and scalar constants must be the fp32 numbers the reference uses;
    building a tensor to round one number costs a device copy (and a host sync on a GPU) per
    call, and a host-only rounding cannot be flushed to zero by an FPU mode."""
    return _fp32_round(value)[0]


def fp32_bits(value: float) -> int:
    """The fp32 bit pattern of `value` rounded to fp32, as a signed int32 (what
    `torch.tensor(value, dtype=torch.float32).view(torch.int32).item()` gives)."""
    bits = _fp32_round(value)[1]
    return bits - (1 << 32) if bits & 0x80000000 else bits
