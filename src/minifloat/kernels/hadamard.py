"""The 16-point random Hadamard transform (NUMERICS.md §6) as Triton device functions.

Bit-exact against numerics.hadamard.random_hadamard_transform, so it follows the reference's
order of operations: signs (exact), four fp32 butterfly stages with strides 1, 2, 4, 8 (a + b,
a - b, a the lower index), times 1/4 (exact), round to bf16. A matrix product would sum in a
different order and differ in the last bit.

Why on "slices": the kernels load a tile as 16 tensors, slice j holding the rows 16 r + j, so
element (r, c) of the 16 slices is one transform run (rows 16 r .. 16 r + 15 of column c). A
butterfly is then an elementwise add between two slices: no permute, reshape or transpose of
the fp32 tile, hence no layout conversion through shared memory (the former formulation viewed
each run as a 2x2x2x2 tensor and permuted it four times; that dominated the RHT kernels).
"""

import triton
import triton.language as tl

from ..numerics.hadamard import RHT_SIGNS, RHT_SIZE
from .element_cast import round_to_bf16

# Bit i set where the sign s_i of the transform is -1.
RHT_NEGATIVE_MASK = tl.constexpr(sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0))
RUN = tl.constexpr(RHT_SIZE)


@triton.jit
def fwht16_slices(xs):
    """Signs and the four butterfly stages (no 1/4, no rounding) of the run held across the
    16-tuple of equally shaped fp32 tensors xs; returns the 16-tuple of stage-4 outputs.

    A sign of -1 multiplies its operand by -1 before any addition, as the reference does, so
    every sum is the reference's bit for bit (Triton's unary minus is 0 - x, which turns -0 into
    +0 and would flip the sign of exact-zero results)."""
    runs = ()
    for j in tl.static_range(RUN):
        runs = runs + ((xs[j] * -1.0,) if (RHT_NEGATIVE_MASK >> j) & 1 else (xs[j],))
    for stage in tl.static_range(4):
        staged = ()
        for j in tl.static_range(RUN):
            if (j >> stage) & 1:  # the upper index of a pair: a - b, a at j - stride
                staged = staged + (runs[j - (1 << stage)] - runs[j],)
            else:
                staged = staged + (runs[j] + runs[j + (1 << stage)],)
        runs = staged
    return runs


@triton.jit
def rht16_slices(xs, HW_ROUND: tl.constexpr):
    """The RHT of the runs held across the 16-tuple xs (see fwht16_slices): bf16 values as
    fp32, in a 16-tuple shaped like xs.

    HW_ROUND (CUDA only) rounds to bf16 by the hardware conversion (cvt.rn.bf16x2.f32: round
    to nearest even, subnormals kept, NaN stays NaN, overflow to inf), two values per
    instruction instead of ~7 integer ops each; the interpreter keeps the integer rounding
    (its bf16 casts flush subnormals). Both give the same values."""
    runs = fwht16_slices(xs)
    out = ()
    for j in tl.static_range(RUN):
        if HW_ROUND:
            out = out + (_hardware_round_to_bf16(runs[j] * 0.25),)
        else:
            out = out + (round_to_bf16(runs[j] * 0.25),)
    return out


@triton.jit
def _hardware_round_to_bf16(x):
    """fp32 -> bf16 (nearest even) -> fp32 by cvt.rn.bf16x2.f32, one instruction per two
    values (Triton's own cast converts one value per instruction), then a shift or mask."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
        "and.b32 $1, t, 0xffff0000; }",
        "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def rht16_peak_bits(xs):
    """Bits of max |RHT| over all runs held across the 16-tuple xs (a scalar int32).

    Scaling by 1/4 in fp32 and rounding to bf16 are both monotone in |v|, so they commute with
    the maximum: they are applied once to the peak of the unscaled butterflies instead of to
    every element (same bits; NaN stays on top as the largest magnitude pattern)."""
    runs = fwht16_slices(xs)
    peak = runs[0].to(tl.int32, bitcast=True) & 0x7FFFFFFF
    for j in tl.static_range(1, RUN):
        peak = tl.maximum(peak, runs[j].to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    peak = tl.max(tl.max(peak, axis=1), axis=0).to(tl.float32, bitcast=True)
    return round_to_bf16(peak * 0.25).to(tl.int32, bitcast=True) & 0x7FFFFFFF
