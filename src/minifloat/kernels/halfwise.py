"""Halfwise maxima of int32 words that hold two 16-bit magnitudes (the words kernels' amaxes).

A bf16 |x| with its sign bit cleared, read as an unsigned 16-bit half, is ordered like the
magnitude with every NaN above inf, so the halfwise max of `word & 0x7FFF7FFF` is torch.amax's
NaN-propagating absolute max, two elements per instruction: max.u16x2 on sm_90+, two masked
integer maxima elsewhere (the interpreter, sm_89). Shared by the per-tensor FP8, block FP8,
MXFP8 and NVFP4 words kernels so each uses the same bit rule.
"""

from __future__ import annotations

from .fp8_common import jit, tl


@jit
def max_u16x2(a, b):
    """Halfwise unsigned max of int32 words (max.u16x2, sm_90+): two magnitudes at once."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@jit
def max_halves(a, b):
    """max_u16x2 in plain integer ops (the interpreter's path) for words whose bits 15 and 31
    are clear, as the masked magnitudes are."""
    return tl.maximum(a & 0xFFFF, b & 0xFFFF) | tl.maximum(a & 0x7FFF0000, b & 0x7FFF0000)


@jit
def max_u16x2_pairs(a0, a1, b0, b1):
    """Combine function of a two-tensor max_u16x2 reduction (one shared-memory round)."""
    return max_u16x2(a0, b0), max_u16x2(a1, b1)


@jit
def max_halves_pairs(a0, a1, b0, b1):
    """Combine function of a two-tensor max_halves reduction."""
    return max_halves(a0, b0), max_halves(a1, b1)


@jit
def max16(a, b, MAX_U16X2: tl.constexpr):
    """max_u16x2 where the target has it (MAX_U16X2), max_halves otherwise."""
    return max_u16x2(a, b) if MAX_U16X2 else max_halves(a, b)


@jit
def reduce16(pairs, axis: tl.constexpr, MAX_U16X2: tl.constexpr):
    """Halfwise maxima of a word tensor along `axis`."""
    return tl.reduce(pairs, axis, max_u16x2) if MAX_U16X2 else tl.reduce(pairs, axis, max_halves)


@jit
def reduce16_pairs(low, high, axis: tl.constexpr, MAX_U16X2: tl.constexpr):
    """Halfwise maxima of two word tensors along `axis`, in one reduction."""
    if MAX_U16X2:
        low, high = tl.reduce((low, high), axis, max_u16x2_pairs)
    else:
        low, high = tl.reduce((low, high), axis, max_halves_pairs)
    return low, high


@jit
def halves_amax(pairs):
    """fp32 bits of the larger bf16 magnitude of each word (both halves folded)."""
    return tl.maximum(pairs & 0xFFFF, pairs >> 16) << 16
