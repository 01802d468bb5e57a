"""Per-tensor absolute maximum on device (NUMERICS.md §2 step 1), without a host sync.

Grid-stride programs each reduce their share of the tensor to one value and fold it into a device
fp32 scalar with one atomic max (compute_amax), or leave it in a slot of their own for the
consuming kernel to reduce (amax_partials). The max runs on the int32 bit patterns of |x| (see
fp8_common): non-negative floats order like their bits, and every NaN pattern with its sign
cleared is larger than +inf, so a NaN anywhere gives a NaN amax, as numerics.compute_amax does.
"""

from __future__ import annotations

import torch

from .fp8_common import (
    _sm_count,
    abs_bits,
    cdiv,
    float32_value,
    jit,
    kernel_input,
    max_programs,
    reciprocal_rn,
    scale_from_amax,
    tl,
)
from .launch import launch

AMAX_BLOCK = 4096
AMAX_UNROLL = 4  # independent loads issued per loop step (memory-level parallelism)
AMAX_WARPS = 8
PROGRAMS_PER_SM = 4
# bf16 inputs: take the max over the 16-bit patterns (|x| bits = bits & 0x7FFF) and widen once at
# the end (fp32 bits = bf16 bits << 16, exact), instead of converting every element to fp32.
# Same ordering (NaN patterns 0x7F81.. above inf 0x7F80), half the register traffic.
AMAX_BF16_BITS = True


@jit
def program_amax_bits(x_ptr, n, pid, programs, iterations, BLOCK: tl.constexpr,
                      UNROLL: tl.constexpr, BF16_BITS: tl.constexpr):
    """max|x| over program `pid`'s grid-stride share of the flat x[0:n], as int32 fp32 bits.

    Super-blocks of UNROLL * BLOCK elements: pid, pid + programs, ... A while loop, not
    range(iterations): the interpreter cannot take a runtime bound in range() with recent numpy.
    Shared by the amax kernel and the one-launch current-scaling kernel (per_tensor_fp8)."""
    running = tl.zeros([BLOCK], dtype=tl.int16 if BF16_BITS else tl.int32)
    i = 0
    while i < iterations:
        base = (pid + i * programs).to(tl.int64) * (BLOCK * UNROLL)
        for u in tl.static_range(UNROLL):
            offsets = base + u * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
            if BF16_BITS:
                running = tl.maximum(running, x.to(tl.int16, bitcast=True) & 0x7FFF)
            else:
                running = tl.maximum(running, abs_bits(x))
        i += 1
    result = tl.max(running, axis=0).to(tl.int32)
    if BF16_BITS:
        result = result << 16  # bf16 bits -> the same value's fp32 bits
    return result


@jit
def _amax_kernel(x_ptr, amax_bits_ptr, n, iterations, BLOCK: tl.constexpr,
                 UNROLL: tl.constexpr, PARTIALS: tl.constexpr, BF16_BITS: tl.constexpr):
    pid = tl.program_id(0)
    result = program_amax_bits(x_ptr, n, pid, tl.num_programs(0), iterations, BLOCK, UNROLL,
                               BF16_BITS)
    if PARTIALS:  # one slot per program, reduced by the consumer: no zeroed buffer needed
        tl.store(amax_bits_ptr + pid, result)
    else:
        tl.atomic_max(amax_bits_ptr, result)


@jit
def reduce_partials(partials_ptr, count, PARTIALS_BLOCK: tl.constexpr):
    """The amax held as per-program partial maxima (int32 |x| bits): their max, as fp32."""
    index = tl.arange(0, PARTIALS_BLOCK)
    bits = tl.load(partials_ptr + index, mask=index < count, other=0)
    return tl.max(bits, axis=0).to(tl.float32, bitcast=True)


@jit
def current_scale(amax_ptr, partial_count, eps, E5M2: tl.constexpr, POW2: tl.constexpr,
                  PARTIALS_BLOCK: tl.constexpr):
    """(amax, scale) of current scaling in a cast kernel: amax_ptr holds the fp32 amax (already
    reduced) or, with PARTIALS_BLOCK > 0, amax_partials' per-program maxima; the scale follows
    numerics.scale_from_amax with overflow value FLT_MAX (0x7F7FFFFF). The rule of
    per_tensor_fp8.per_tensor_cast_kernel (the one-launch kernel derives its scale from the
    barrier's amax the same way)."""
    if PARTIALS_BLOCK > 0:
        amax = reduce_partials(amax_ptr, partial_count, PARTIALS_BLOCK)
    else:
        amax = tl.load(amax_ptr)
    return amax, scale_from_amax(amax, eps, E5M2, POW2, 0x7F7FFFFF)


def _programs(x: torch.Tensor) -> tuple[int, int]:
    """(programs, loop iterations of each) for a grid-stride pass over x."""
    blocks = cdiv(x.numel(), AMAX_BLOCK * AMAX_UNROLL)
    if x.is_cuda:
        cap = PROGRAMS_PER_SM * _sm_count(x.device.index if x.device.index is not None else 0)
    else:
        cap = max_programs(x.device)
    programs = min(blocks, cap)
    return programs, cdiv(blocks, programs)


def _bf16_bits(x: torch.Tensor) -> bool:
    return AMAX_BF16_BITS and x.dtype == torch.bfloat16


def amax_partials(x: torch.Tensor) -> torch.Tensor:
    """max|x| as per-program partial maxima: an int32 tensor of |x| bit patterns, one per program
    (reduce_partials in the consuming kernel takes their max).

    Why: compute_amax needs a zeroed output, one more allocation and launch on the host's
    critical path; the partials need neither (every slot is written). Used by current scaling
    when no amax reduction group is set.
    """
    if not kernel_input(x):
        raise ValueError(
            "amax_partials kernel needs a non-empty contiguous float32/bfloat16/float16 tensor; "
            f"got dtype {x.dtype}, shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
        )
    programs, iterations = _programs(x)
    partials = torch.empty(programs, dtype=torch.int32, device=x.device)
    launch(_amax_kernel, (programs,), x, partials, x.numel(), iterations, BLOCK=AMAX_BLOCK,
           UNROLL=AMAX_UNROLL, PARTIALS=True, BF16_BITS=_bf16_bits(x), num_warps=AMAX_WARPS)
    return partials


def compute_amax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """max|x| as a 0-dim fp32 device tensor (NaN if x holds a NaN; 0 for an empty tensor).

    With `out` (fp32, on x's device) the result is folded into it in place, out = max(out, amax),
    which is how delayed scaling records an amax; `out` is returned.
    """
    if not kernel_input(x):
        raise ValueError(
            "compute_amax kernel needs a non-empty contiguous float32/bfloat16/float16 tensor; "
            f"got dtype {x.dtype}, shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
        )
    if out is None:
        out = torch.zeros((), dtype=torch.float32, device=x.device)
    elif out.dtype != torch.float32 or out.device != x.device or out.numel() != 1:
        raise ValueError("compute_amax: `out` must be a 1-element float32 tensor on x's device")
    programs, iterations = _programs(x)
    launch(_amax_kernel, (programs,), x, out.view(torch.int32), x.numel(), iterations,
           BLOCK=AMAX_BLOCK, UNROLL=AMAX_UNROLL, PARTIALS=False, BF16_BITS=_bf16_bits(x),
           num_warps=AMAX_WARPS)
    return out


@jit
def _scales_kernel(amax_ptr, scale_ptr, scale_inv_ptr, eps, count, BLOCK: tl.constexpr,
                   E5M2: tl.constexpr, POW2: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < count
    scale = scale_from_amax(tl.load(amax_ptr + offsets, mask=mask, other=1.0), eps, E5M2, POW2,
                            0x7F7FFFFF)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(scale_inv_ptr + offsets, reciprocal_rn(scale), mask=mask)


MAX_SCALES = 4096  # amaxes one scales_from_amax launch takes (one program)


def scales_from_amax(amax: torch.Tensor, e5m2: bool, amax_epsilon: float,
                     power_2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv), amax's shape, of per-tensor current scaling for each fp32 amax (one,
    or one per tensor: a MoE's experts; at most MAX_SCALES), in one launch:
    numerics.scale_from_amax and torch.reciprocal, with the cast kernels' rule
    (current_scale). For a cast made elsewhere (input_recast.py, grouped_offsets.py), where a
    dozen small torch ops would otherwise compute it."""
    count = amax.numel()
    if count > MAX_SCALES:
        raise ValueError(f"scales_from_amax: {count} amaxes, at most {MAX_SCALES} in one launch")
    scale = torch.empty(amax.shape, dtype=torch.float32, device=amax.device)
    scale_inv = torch.empty(amax.shape, dtype=torch.float32, device=amax.device)
    launch(_scales_kernel, (1,), amax.contiguous(), scale, scale_inv,
           float32_value(amax_epsilon), count,
           BLOCK=max(16, 1 << (count - 1).bit_length()), E5M2=e5m2, POW2=power_2_scale,
           num_warps=1)
    return scale, scale_inv
