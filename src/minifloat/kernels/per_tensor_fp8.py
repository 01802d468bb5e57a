"""Per-tensor FP8 quantization kernels: current scaling and delayed scaling (NUMERICS.md §2, §3).

One pass over the input writes the rowwise data [M, K] and its transpose [K, M] (the columnwise
copy, a byte transpose with the same scale_inv): each program casts one TILE_M x TILE_K tile
with per_tensor_tile.per_tensor_tile (words of four elements in, words of four codes out; the
host picks its load and store modes from the dtype, shape and alignment: tile_constexprs).

- Current scaling: the amax kernel (amax.py) reduces max|x| into a device scalar (the caller may
  all-reduce it in between) or, without a reduction, leaves per-program partial maxima that
  every cast program reduces itself; then the cast kernel derives scale and scale_inv from that
  amax on device, exactly as numerics.scale_from_amax does, and casts. Two launches, no host
  sync. On CUDA without a given amax the two are one launch (_one_launch_kernel): the same
  amax and tile functions around a grid barrier.
- Delayed scaling: the cast uses the given scale tensor and folds this tensor's amax into the
  given amax tensor in the same pass (an atomic max per tile).

Bytes equal numerics.quantize_current_scaling / quantize_with_scale (the tests check raw bytes).
"""

from __future__ import annotations

import os

import torch

from . import amax as amax_kernels
from .amax import current_scale, program_amax_bits
from .fp8_common import (
    _sm_count,
    cdiv,
    float32_value,
    hw_cast,
    is_e5m2,
    jit,
    kernel_input,
    max_u16x2,
    needs_wide_offsets,
    reads_halves,
    reciprocal_rn,
    scale_from_amax,
    tl,
    triton,
)
from .launch import _INTERPRET, launch_planned
from .per_tensor_tile import nan_possible, per_tensor_tile, scale_makes_nan

# 64x128 tiles, 4 warps (64 elements a thread). Swept on an H100 with the hardware cast
# (benchmarks/KERNEL_NOTES.md, "per-tensor FP8 v3"). Powers of two of at least 16.
TILE_M = 64
TILE_K = 128
NUM_WARPS = 4
# Tiles for shapes whose copies are stored byte by byte (M or K not a multiple of 4): the bytes
# are split off words in registers, and at 64x128 that spilled (255 registers, sm_90 compile;
# 32x64: 118, no spill).
BYTES_TILE_M = 32
BYTES_TILE_K = 64
# Current scaling in one launch (_one_launch_kernel): on CUDA, unless
# MINIFLOAT_ONE_LAUNCH_CURRENT=0. Programs per SM: two programs of ONE_LAUNCH_WARPS = 4 warps
# always fit one SM together (2 x 128 threads x 255 registers <= 64K registers, shared memory
# a few KiB), which the grid barrier needs: every program of the grid must be resident at once.
ONE_LAUNCH = os.environ.get("MINIFLOAT_ONE_LAUNCH_CURRENT", "1") != "0"
ONE_LAUNCH_PROGRAMS_PER_SM = 2
ONE_LAUNCH_WARPS = 4
ONE_LAUNCH_AMAX_BLOCK = 2048
ONE_LAUNCH_AMAX_UNROLL = 4
# The cast pass walks the tiles from the last to the first: the amax pass ends on the tensor's
# last bytes, which are then still in L2 (50 MB on an H100 or H200) and are read first, so a
# tensor of a few tens of MB (a 1b layer's input or weight) is read from HBM about once, not
# twice. False walks them in the amax pass's order (benchmarks/quantize_bandwidth.py compares).
ONE_LAUNCH_CAST_REVERSED = True
# Tests only: run the CUDA algorithm (cvt stand-in with a wrong NaN byte, NaN fix-up per tile,
# plain halfwise maxima) under the interpreter.
EMULATE_PRODUCTS = False


@jit
def per_tensor_cast_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr,
                           eps, M, K, partial_count, E5M2: tl.constexpr, CURRENT: tl.constexpr,
                           POW2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HALVES: tl.constexpr,
                           ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr,
                           MASK_M: tl.constexpr, MASK_K: tl.constexpr, WIDE: tl.constexpr,
                           HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr,
                           MAX_U16X2: tl.constexpr, PARTIALS_BLOCK: tl.constexpr):
    """One tile per program. CURRENT: the scale from the amax at amax_ptr (a reduced scalar or,
    with PARTIALS_BLOCK > 0, amax_partials' maxima); else the delayed scale at scale_ptr, and
    the tile's max|x| folded into the int32 view of the amax at amax_ptr. x_ptr, data_ptr and
    data_t_ptr are the views per_tensor_tile's modes ask for."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    if CURRENT:
        amax, scale = current_scale(amax_ptr, partial_count, eps, E5M2, POW2, PARTIALS_BLOCK)
    else:
        scale = tl.load(scale_ptr)
    if CURRENT and PARTIALS_BLOCK > 0:
        # the partial maxima are this tensor's: its amax is NaN exactly when it holds a NaN
        per_tensor_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, nan_possible(scale, amax),
                        M, K, pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, False, False, BLOCK_M,
                        BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE, HW_CAST,
                        PRODUCTS, MAX_U16X2)
    elif CURRENT:  # a given amax says nothing about this tensor's NaNs: check the tile
        per_tensor_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, scale_makes_nan(scale),
                        M, K, pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, False, HW_CAST or PRODUCTS,
                        BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE,
                        HW_CAST, PRODUCTS, MAX_U16X2)
    else:  # delayed: the tiles take their maxima anyway and check their own NaN
        per_tensor_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, scale_makes_nan(scale),
                        M, K, pid_m, pid_k, E5M2, ROWWISE, COLUMNWISE, True, True, BLOCK_M, BLOCK_K,
                        HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE, HW_CAST, PRODUCTS,
                        MAX_U16X2)
    if pid == 0:
        tl.store(scale_inv_ptr, reciprocal_rn(scale))


@jit
def _one_launch_kernel(x_ptr, x_tile_ptr, data_ptr, data_t_ptr, sync_ptr, scale_inv_ptr, eps,
                       M, K, n, amax_iterations, E5M2: tl.constexpr, POW2: tl.constexpr,
                       ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, HALVES: tl.constexpr, ROW_WORDS: tl.constexpr,
                       COL_WORDS: tl.constexpr, MASK_M: tl.constexpr, MASK_K: tl.constexpr,
                       WIDE: tl.constexpr, HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr,
                       MAX_U16X2: tl.constexpr, AMAX_BLOCK: tl.constexpr,
                       AMAX_UNROLL: tl.constexpr, BF16_BITS: tl.constexpr,
                       REVERSED: tl.constexpr):
    """Current scaling in one launch: amax, grid barrier, scale, cast (+ transpose).

    Why: the two-launch form (amax partials, then the cast) costs a launch and an allocation of
    host time per quantization, and an eager FP8 Linear quantizes three tensors a step. Every
    program folds max|x| over its grid-stride share of x_ptr (the elements) into sync[2] (int32
    |x| bits, NaN above inf), arrives at sync[0] and spins until all have arrived, derives the
    scale from the whole tensor's amax exactly as the cast kernels do, then casts its share of
    the tiles (x_tile_ptr: the view the tile's modes ask for). The last program to leave
    (sync[1]) zeroes sync[0..2] for the next launch on the stream. The grid must fit the GPU at
    once (the host sizes it); the interpreter runs programs one by one and never takes this
    kernel. REVERSED: the cast pass takes the tiles last first (ONE_LAUNCH_CAST_REVERSED says
    why).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    bits = program_amax_bits(x_ptr, n, pid, programs, amax_iterations, AMAX_BLOCK, AMAX_UNROLL,
                             BF16_BITS)
    tl.atomic_max(sync_ptr + 2, bits, sem="relaxed")
    tl.atomic_add(sync_ptr, 1, sem="release")
    arrived = tl.atomic_add(sync_ptr, 0, sem="acquire")
    while arrived < programs:
        arrived = tl.atomic_add(sync_ptr, 0, sem="acquire")
    amax = tl.atomic_max(sync_ptr + 2, 0, sem="acquire").to(tl.float32, bitcast=True)
    scale = scale_from_amax(amax, eps, E5M2, POW2, 0x7F7FFFFF)
    may_be_nan = nan_possible(scale, amax)  # the amax is this tensor's whole amax
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_k
    tile = pid
    while tile < tiles:
        index = tiles - 1 - tile if REVERSED else tile
        per_tensor_tile(x_tile_ptr, data_ptr, data_t_ptr, sync_ptr, scale, may_be_nan, M, K,
                        index // tiles_k, index % tiles_k, E5M2, ROWWISE, COLUMNWISE, False,
                        False, BLOCK_M, BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K,
                        WIDE, HW_CAST, PRODUCTS, MAX_U16X2)
        tile += programs
    if pid == 0:
        tl.store(scale_inv_ptr, reciprocal_rn(scale))
    departed = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if departed == programs - 1:  # everyone has read the amax: reset for the next launch
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)
        tl.atomic_xchg(sync_ptr + 2, 0)


def _matrix_shape(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    k = x.shape[-1]
    return x.numel() // k, k


def tile_modes(x: torch.Tensor, m: int, k: int, tile_m: int, tile_k: int) -> dict[str, bool]:
    """per_tensor_tile's load and store modes for x viewed as [M, K] in tile_m x tile_k tiles:
    HALVES for bf16 rows of whole int64 words (K % 4 == 0) at 8-byte aligned addresses, words
    stores where K % 4 == 0 (rowwise) and M % 4 == 0 (columnwise), masks for partial tiles,
    64-bit in-tile offsets for huge tensors. Shared with the multi-tensor launches, which ask
    it for every tensor of a group."""
    return {"HALVES": reads_halves(x, k), "ROW_WORDS": k % 4 == 0, "COL_WORDS": m % 4 == 0,
            "MASK_M": m % tile_m != 0, "MASK_K": k % tile_k != 0,
            "WIDE": needs_wide_offsets(m, k, max(tile_m, tile_k))}


def tile_views(x: torch.Tensor, rows_out: torch.Tensor, cols_out: torch.Tensor,
               modes: dict[str, bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input, rowwise output, columnwise output) as the modes read and write them: int64 words
    of the input under HALVES, int32 words of an output stored in words (a 1-element dummy
    output stays as it is)."""
    def words(buffer: torch.Tensor, on: bool) -> torch.Tensor:
        return buffer.view(torch.int32) if on and buffer.dtype == torch.uint8 else buffer
    x_view = x.reshape(-1).view(torch.int64) if modes["HALVES"] else x
    return (x_view, words(rows_out, modes["ROW_WORDS"]), words(cols_out, modes["COL_WORDS"]))


def tile_constexprs(x: torch.Tensor, m: int, k: int) -> dict:
    """The tile constexprs of a single-tensor launch (and of the grouped cast's, which casts
    with the same tile): the tile (BYTES_TILE_* where a copy is stored in bytes), the modes,
    the conversion path."""
    words = m % 4 == 0 and k % 4 == 0
    tile_m, tile_k = (TILE_M, TILE_K) if words else (BYTES_TILE_M, BYTES_TILE_K)
    hw = hw_cast(x)
    return {"BLOCK_M": tile_m, "BLOCK_K": tile_k, **tile_modes(x, m, k, tile_m, tile_k),
            "HW_CAST": hw, "PRODUCTS": hw or EMULATE_PRODUCTS, "MAX_U16X2": max_u16x2(x)}


def _settings() -> tuple:
    """The module settings a launch plan depends on, part of every plan key: tests switch them
    (tile sizes, EMULATE_PRODUCTS, needs_wide_offsets) and must get the kernel variant they ask
    for, not a plan cached under other settings."""
    return (TILE_M, TILE_K, BYTES_TILE_M, BYTES_TILE_K, EMULATE_PRODUCTS, needs_wide_offsets,
            ONE_LAUNCH_CAST_REVERSED, amax_kernels.AMAX_BF16_BITS)


# plan key -> (grid, constexprs): what a cast's shape, options and pointer alignments decide,
# once (see _launch)
_CAST_PLANS: dict[tuple, tuple] = {}


def _launch(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: torch.Tensor | None,
    amax: torch.Tensor,
    amax_epsilon: float,
    partials: bool = False,
    power_2_scale: bool,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One cast launch with a given scale (delayed scaling) or amax (current scaling: a reduced
    scalar, or per-program partial maxima).

    Why planned: delayed scaling casts every operand of every GEMM here (three launches a
    Linear), and building kernels.launch's key from every argument and the constexprs below
    cost tens of microseconds a call on the GPU hosts; the plan key holds every fact launch's
    key would (dtypes, shapes, pointer alignments, flags, module settings), so launch_planned
    can skip both after the first call."""
    if not kernel_input(x):
        raise ValueError(
            "per-tensor FP8 kernels need a non-empty contiguous float32/bfloat16/float16 tensor; "
            f"got dtype {x.dtype}, shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
        )
    if not (rowwise or columnwise):
        raise ValueError("per-tensor FP8 kernel: ask for the rowwise or the columnwise copy")
    m, k = _matrix_shape(x)
    index = x.get_device()
    current = scale is None
    plan_key = ("cast", x.dtype, m, k, fp8_dtype, current, power_2_scale, rowwise, columnwise,
                partials, amax.numel(), amax.dtype, x.data_ptr() % 16, amax.data_ptr() % 16,
                None if current else (scale.dtype, scale.data_ptr() % 16), index, _settings())
    plan = _CAST_PLANS.get(plan_key)
    if plan is None:
        constexprs = {"E5M2": is_e5m2(fp8_dtype), "CURRENT": current, "POW2": power_2_scale,
                      "ROWWISE": rowwise, "COLUMNWISE": columnwise,
                      **tile_constexprs(x, m, k),
                      "PARTIALS_BLOCK": _partials_block(amax, partials)}
        tiles = cdiv(m, constexprs["BLOCK_M"]) * cdiv(k, constexprs["BLOCK_K"])
        plan = _CAST_PLANS[plan_key] = ((tiles,), constexprs)
    grid, constexprs = plan
    device = x.device
    data = torch.empty((m, k), dtype=torch.uint8, device=device) if rowwise else None
    data_t = torch.empty((k, m), dtype=torch.uint8, device=device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    # the dummy for an absent output: the constexpr flags skip its stores
    x_arg, rows_out, cols_out = tile_views(x, data if data is not None else scale_inv,
                                           data_t if data_t is not None else scale_inv,
                                           constexprs)
    launch_planned(
        plan_key, index, per_tensor_cast_kernel, grid, x_arg, rows_out, cols_out,
        scale_inv if current else scale, amax if current else amax.view(torch.int32),
        scale_inv, float32_value(amax_epsilon), m, k, amax.numel() if partials else 1,
        num_warps=NUM_WARPS, **constexprs)
    return (
        None if data is None else data.view(fp8_dtype),
        None if data_t is None else data_t.view(fp8_dtype),
        scale_inv,
    )


def _partials_block(amax: torch.Tensor, partials: bool) -> int:
    return triton.next_power_of_2(amax.numel()) if partials else 0


# The one-launch kernel's barrier slots: per device one int32 pool of SYNC_SLOTS x 4 (arrive,
# depart, amax bits, unused), zero between launches, and a slot per stream: two streams (FSDP2
# quantizes on its all-gather stream) must never count into the same barrier. The pool is
# allocated outside any CUDA-graph capture: memory allocated during a capture or a cudagraph-tree
# warm-up belongs to the graph's private pool, which reuses it once it looks dead, and a barrier
# counter overwritten there corrupts every later launch (found under torch.compile
# mode="reduce-overhead"). A stream of its own is not enough: torch 2.11's cudagraph trees send
# every allocation of the warming-up thread to their pool (and then refuse to run: "tensor(s) in
# the cudagraph pool not tracked as outputs", when a model's first minifloat kernel ran there),
# so compiled modules allocate it when they are bound, at trace time (prepare_sync_pool). A
# capture that finds no pool, or no free slot, takes the two launches.
SYNC_SLOTS = 256
_SYNC_POOLS: dict[int, torch.Tensor] = {}
_SYNC_SLOT: dict[tuple[int, int], torch.Tensor] = {}  # (device, raw stream) -> its [4] slot


def prepare_sync_pool(device: torch.device) -> None:
    """Allocate the device's barrier pool now, if it is not yet (see above); call it outside
    any capture or compiled region."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SYNC_POOLS or torch.cuda.is_current_stream_capturing():
        return
    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side):
        pool = torch.zeros(SYNC_SLOTS, 4, dtype=torch.int32, device=device)
    torch.cuda.current_stream(device).wait_stream(side)
    _SYNC_POOLS[index] = pool


def _sync_slot(x: torch.Tensor, index: int) -> torch.Tensor | None:
    stream = torch._C._cuda_getCurrentRawStream(index)
    slot = _SYNC_SLOT.get((index, stream))
    if slot is not None:
        return slot
    prepare_sync_pool(x.device)
    pool = _SYNC_POOLS.get(index)
    if pool is None:
        return None
    used = sum(1 for key in _SYNC_SLOT if key[0] == index)
    if used == SYNC_SLOTS:
        return None
    slot = _SYNC_SLOT[(index, stream)] = pool[used]
    return slot


# plan key -> (grid, amax iterations, constexprs): what a shape and its options decide, once
_ONE_LAUNCH_PLANS: dict[tuple, tuple[tuple[int], int, dict]] = {}


def _one_launch_applies(x: torch.Tensor) -> bool:
    return ONE_LAUNCH and not _INTERPRET and x.is_cuda and kernel_input(x)


def _one_launch_plan(x: torch.Tensor, m: int, k: int, e5m2: bool, power_2_scale: bool,
                     rowwise: bool, columnwise: bool, index: int) -> tuple[tuple[int], int, dict]:
    tile = tile_constexprs(x, m, k)
    tiles = cdiv(m, tile["BLOCK_M"]) * cdiv(k, tile["BLOCK_K"])
    amax_blocks = cdiv(m * k, ONE_LAUNCH_AMAX_BLOCK * ONE_LAUNCH_AMAX_UNROLL)
    programs = min(ONE_LAUNCH_PROGRAMS_PER_SM * _sm_count(index), max(tiles, amax_blocks))
    constexprs = {
        "E5M2": e5m2, "POW2": power_2_scale, "ROWWISE": rowwise, "COLUMNWISE": columnwise,
        **tile, "AMAX_BLOCK": ONE_LAUNCH_AMAX_BLOCK, "AMAX_UNROLL": ONE_LAUNCH_AMAX_UNROLL,
        "BF16_BITS": amax_kernels.AMAX_BF16_BITS and x.dtype == torch.bfloat16,
        "REVERSED": ONE_LAUNCH_CAST_REVERSED,
    }
    return (programs,), cdiv(amax_blocks, programs), constexprs


def _one_launch(x: torch.Tensor, fp8_dtype: torch.dtype, amax_epsilon: float,
                power_2_scale: bool, rowwise: bool, columnwise: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """quantize_current_scaling without a given amax, in one launch (_one_launch_kernel)."""
    if not (rowwise or columnwise):
        raise ValueError("per-tensor FP8 kernel: ask for the rowwise or the columnwise copy")
    m, k = _matrix_shape(x)
    index = x.get_device()
    plan_key = (x.dtype, m, k, fp8_dtype, amax_epsilon, power_2_scale, rowwise, columnwise,
                x.data_ptr() % 16, index, _settings())
    plan = _ONE_LAUNCH_PLANS.get(plan_key)
    if plan is None:
        plan = _ONE_LAUNCH_PLANS[plan_key] = _one_launch_plan(
            x, m, k, is_e5m2(fp8_dtype), power_2_scale, rowwise, columnwise, index)
    grid, amax_iterations, constexprs = plan
    sync = _sync_slot(x, index)
    if sync is None:  # a capture before any pool existed, or every slot taken
        return _launch(x, fp8_dtype, scale=None, amax=amax_kernels.amax_partials(x),
                       amax_epsilon=amax_epsilon, power_2_scale=power_2_scale,
                       rowwise=rowwise, columnwise=columnwise, partials=True)
    data = torch.empty((m, k), dtype=torch.uint8, device=x.device) if rowwise else None
    data_t = torch.empty((k, m), dtype=torch.uint8, device=x.device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    # the dummy for an absent output: the constexpr flags skip its stores
    x_tiles, rows_out, cols_out = tile_views(x, data if data is not None else scale_inv,
                                             data_t if data_t is not None else scale_inv,
                                             constexprs)
    launch_planned(
        ("one_launch", *plan_key), index, _one_launch_kernel, grid, x, x_tiles, rows_out,
        cols_out, sync, scale_inv, float32_value(amax_epsilon), m, k, m * k, amax_iterations,
        num_warps=ONE_LAUNCH_WARPS, **constexprs)
    return (
        None if data is None else data.view(fp8_dtype),
        None if data_t is None else data_t.view(fp8_dtype),
        scale_inv,
    )


def quantize_current_scaling(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor current scaling of the [M, K] view of `x`.

    Returns (data [M, K] or None, data_t [K, M] or None, scale_inv [1] fp32), the copies asked
    for, with the bytes of numerics.quantize_current_scaling. `amax` (a 1-element fp32 tensor on
    x's device) may be given when it was reduced across ranks; otherwise it is computed here.
    """
    if amax is None and _one_launch_applies(x):
        return _one_launch(x, fp8_dtype, amax_epsilon, power_2_scale, rowwise, columnwise)
    if amax is None:  # partial maxima: no zeroed buffer (see amax.amax_partials)
        return _launch(x, fp8_dtype, scale=None, amax=amax_kernels.amax_partials(x),
                       amax_epsilon=amax_epsilon, power_2_scale=power_2_scale, rowwise=rowwise,
                       columnwise=columnwise, partials=True)
    if amax.numel() != 1 or amax.dtype != torch.float32 or amax.device != x.device:
        raise ValueError("quantize_current_scaling: amax must be a 1-element float32 tensor on "
                         "x's device")
    return _launch(x, fp8_dtype, scale=None, amax=amax, amax_epsilon=amax_epsilon,
                   power_2_scale=power_2_scale, rowwise=rowwise, columnwise=columnwise)


def quantize_delayed_scaling(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor delayed scaling: cast with `scale` and fold max|x| into `amax` in place.

    `scale` and `amax` are 1-element fp32 tensors on x's device (the recipe state's slot).
    Returns (data [M, K] or None, data_t [K, M] or None, scale_inv [1] fp32) with the bytes of
    numerics.quantize_with_scale; `amax` ends as max(amax, numerics.compute_amax(x)).
    """
    if not kernel_input(x, scale, amax) or scale.numel() != 1 or amax.numel() != 1:
        raise ValueError("quantize_delayed_scaling: scale and amax must be 1-element float32 "
                         "tensors on x's device")
    return _launch(x, fp8_dtype, scale=scale, amax=amax, amax_epsilon=0.0, power_2_scale=False,
                   rowwise=rowwise, columnwise=columnwise)

