"""Per-tensor FP8 quantization kernels: current scaling and delayed scaling (NUMERICS.md §2, §3).

One pass over the input writes the rowwise data [M, K] and its transpose [K, M] (the columnwise
copy, a byte transpose with the same scale_inv): each program loads one BLOCK_M x BLOCK_K tile,
rounds it once and stores it twice, the second store through a register transpose so both
writes are coalesced. bf16 inputs take the words kernel (per_tensor_fp8_words.py: int64 words of
four elements in, int32 words of four codes out, the transpose done on words); other dtypes,
K % 4 != 0, unaligned inputs and WORDS = False take the element kernel below.

- Current scaling: the amax kernel (amax.py) reduces max|x| into a device scalar (the caller may
  all-reduce it in between) or, without a reduction, leaves per-program partial maxima that
  every cast program reduces itself; then the cast kernel derives scale and scale_inv from that
  amax on device, exactly as numerics.scale_from_amax does, and casts. Two launches, no host
  sync.
- Delayed scaling: the cast uses the given scale tensor and folds this tensor's amax into the
  given amax tensor in the same pass (an atomic max per tile).

Bytes equal numerics.quantize_current_scaling / quantize_with_scale (the tests check raw bytes).
"""

from __future__ import annotations

import torch

from . import amax as amax_kernels
from . import per_tensor_fp8_words as words_kernels
from .amax import current_scale
from .fp8_common import (
    _capability,
    abs_bits,
    cdiv,
    float32_value,
    fp8_codes,
    hw_cast,
    is_e5m2,
    jit,
    kernel_input,
    needs_wide_offsets,
    reciprocal_rn,
    tile_offsets,
    tl,
    triton,
)
from .launch import launch

# 64x128 tiles, 4 warps (64 elements a thread). Swept on an H100 with the hardware cast
# (benchmarks/KERNEL_NOTES.md): 64x64, 32x128, 128x64 with 4 warps within 5%; 8 or 16 warps
# and 128x128 tiles 10-60% slower.
TILE_M = 64
TILE_K = 128
NUM_WARPS = 4
# v3 words kernel (bf16, K % 4 == 0, 8-byte aligned input; M % 4 == 0 when the transposed copy
# is asked for): WORDS_TILE_M x WORDS_TILE_K tiles, WORDS_NUM_WARPS warps. Its SASS per element
# is a fraction of the element kernel's (benchmarks/KERNEL_NOTES.md, "per-tensor FP8 v3").
WORDS = True
WORDS_TILE_M = 64
WORDS_TILE_K = 128
WORDS_NUM_WARPS = 4
# Tests only: run the words kernel's CUDA algorithm (cvt stand-in with a wrong NaN byte, NaN
# fix-up per tile, plain halfwise maxima) under the interpreter.
EMULATE_PRODUCTS = False


@jit
def cast_transpose_tile(x_ptr, data_ptr, data_t_ptr, amax_bits_ptr, scale, M, K, pid_m, pid_k,
                        E5M2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                        RECORD_AMAX: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize tile (pid_m, pid_k) of a row-major [M, K] tensor with one fp32 `scale`.

    Writes data[m, k] (ROWWISE) and data_t[k, m] (COLUMNWISE) as FP8 codes; with RECORD_AMAX,
    atomically folds the tile's max|x| into the int32 bits at amax_bits_ptr. Shared with the
    multi-tensor kernel.
    """
    row0 = pid_m.to(tl.int64) * BLOCK_M
    col0 = pid_k.to(tl.int64) * BLOCK_K
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < M - row0
    col_ok = cols < K - col0
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + row0 * K + col0 + tile_offsets(rows, cols, K, WIDE), mask=mask,
                other=0.0)
    if RECORD_AMAX:
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    codes = fp8_codes(x.to(tl.float32) * scale, E5M2, HW_CAST)
    if ROWWISE:
        tl.store(data_ptr + row0 * K + col0 + tile_offsets(rows, cols, K, WIDE), codes,
                 mask=mask)
    if COLUMNWISE:
        # a register transpose, so that this store runs along M and stays coalesced
        mask_t = col_ok[:, None] & row_ok[None, :]
        tl.store(data_t_ptr + col0 * M + row0 + tile_offsets(cols, rows, M, WIDE),
                 tl.trans(codes), mask=mask_t)


@jit
def _cast_transpose_kernel(x_ptr, data_ptr, data_t_ptr, scale_ptr, amax_ptr, scale_inv_ptr, eps,
                           M, K, partial_count, E5M2: tl.constexpr, CURRENT: tl.constexpr,
                           POW2: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WIDE: tl.constexpr,
                           HW_CAST: tl.constexpr, PARTIALS_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    if CURRENT:
        _, scale = current_scale(amax_ptr, partial_count, eps, E5M2, POW2, PARTIALS_BLOCK)
        cast_transpose_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, M, K, pid_m, pid_k,
                            E5M2, ROWWISE, COLUMNWISE, False, BLOCK_M, BLOCK_K, WIDE, HW_CAST)
    else:
        # amax_ptr: int32 view of the delayed-scaling amax, folded in with an atomic max
        scale = tl.load(scale_ptr)
        cast_transpose_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, M, K, pid_m, pid_k,
                            E5M2, ROWWISE, COLUMNWISE, True, BLOCK_M, BLOCK_K, WIDE, HW_CAST)
    if pid == 0:
        tl.store(scale_inv_ptr, reciprocal_rn(scale))


def _matrix_shape(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    k = x.shape[-1]
    return x.numel() // k, k


def _takes_words(x: torch.Tensor, m: int, k: int, columnwise: bool) -> bool:
    """Whether the words kernel serves x viewed as [M, K]: bf16 (four elements fill an int64
    word), rows of whole words (K % 4 == 0) at 8-byte aligned addresses, whole transposed
    words (M % 4 == 0) when that copy is asked for, power-of-two tiles of at least 4 x 4 words,
    and in-tile word offsets within int32. Others take the element kernel."""
    tile_m, tile_k = WORDS_TILE_M, WORDS_TILE_K
    return (WORDS and x.dtype == torch.bfloat16 and k % 4 == 0 and x.data_ptr() % 8 == 0
            and x.storage_offset() % 4 == 0 and (m % 4 == 0 or not columnwise)
            and tile_m >= 16 and tile_k >= 16 and tile_m & (tile_m - 1) == 0
            and tile_k & (tile_k - 1) == 0 and max(tile_m * k, tile_k * m) // 4 + tile_k < 2**31)


def _words_view(buffer: torch.Tensor) -> torch.Tensor:
    """A uint8 output [rows, cols] as int32 words [rows, cols / 4] (the dummy stays as is)."""
    return buffer.view(torch.int32) if buffer.dim() == 2 else buffer


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
    if not kernel_input(x):
        raise ValueError(
            "per-tensor FP8 kernels need a non-empty contiguous float32/bfloat16/float16 tensor; "
            f"got dtype {x.dtype}, shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
        )
    if not (rowwise or columnwise):
        raise ValueError("per-tensor FP8 kernel: ask for the rowwise or the columnwise copy")
    e5m2 = is_e5m2(fp8_dtype)
    m, k = _matrix_shape(x)
    device = x.device
    data = torch.empty((m, k), dtype=torch.uint8, device=device) if rowwise else None
    data_t = torch.empty((k, m), dtype=torch.uint8, device=device) if columnwise else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    dummy = scale_inv  # stands in for absent outputs; the constexpr flags skip their stores
    if _takes_words(x, m, k, columnwise):
        hw = hw_cast(x)
        scalars, flags = _shared_arguments(scale, amax, scale_inv, amax_epsilon, partials, e5m2,
                                           power_2_scale, rowwise, columnwise, m, k)
        launch(
            words_kernels.per_tensor_words_kernel,
            (cdiv(m, WORDS_TILE_M) * cdiv(k, WORDS_TILE_K),),
            x.reshape(m, k).view(torch.int64),
            _words_view(data if data is not None else dummy),
            _words_view(data_t if data_t is not None else dummy),
            *scalars,
            **flags,
            BLOCK_M=WORDS_TILE_M,
            BLOCK_K=WORDS_TILE_K,
            HW_CAST=hw,
            PRODUCTS=hw or EMULATE_PRODUCTS,
            MAX_U16X2=hw and _capability(device.index if device.index is not None else 0)
            >= (9, 0),
            MASK_M=m % WORDS_TILE_M != 0,
            MASK_K=k % WORDS_TILE_K != 0,
            PARTIALS_BLOCK=_partials_block(amax, partials),
            num_warps=WORDS_NUM_WARPS,
        )
    else:
        _launch_elements(x, data, data_t, scale, amax, scale_inv, amax_epsilon, partials,
                         e5m2, power_2_scale, rowwise, columnwise, m, k)
    return (
        None if data is None else data.view(fp8_dtype),
        None if data_t is None else data_t.view(fp8_dtype),
        scale_inv,
    )


def _shared_arguments(scale: torch.Tensor | None, amax: torch.Tensor, scale_inv: torch.Tensor,
                      amax_epsilon: float, partials: bool, e5m2: bool, power_2_scale: bool,
                      rowwise: bool, columnwise: bool, m: int, k: int) -> tuple[tuple, dict]:
    """The runtime arguments after the three data pointers, and the flags, that the element
    and the words kernels take alike (the same scale logic: see _cast_transpose_kernel)."""
    current = scale is None
    scalars = (scale_inv if current else scale, amax if current else amax.view(torch.int32),
               scale_inv, float32_value(amax_epsilon), m, k, amax.numel() if partials else 1)
    flags = {"E5M2": e5m2, "CURRENT": current, "POW2": power_2_scale, "ROWWISE": rowwise,
             "COLUMNWISE": columnwise}
    return scalars, flags


def _partials_block(amax: torch.Tensor, partials: bool) -> int:
    return triton.next_power_of_2(amax.numel()) if partials else 0


def _launch_elements(x: torch.Tensor, data: torch.Tensor | None, data_t: torch.Tensor | None,
                     scale: torch.Tensor | None, amax: torch.Tensor, scale_inv: torch.Tensor,
                     amax_epsilon: float, partials: bool, e5m2: bool, power_2_scale: bool,
                     rowwise: bool, columnwise: bool, m: int, k: int) -> None:
    """The element kernel (_cast_transpose_kernel): any kernel input dtype and shape."""
    dummy = scale_inv
    grid = (cdiv(m, TILE_M) * cdiv(k, TILE_K),)
    scalars, flags = _shared_arguments(scale, amax, scale_inv, amax_epsilon, partials, e5m2,
                                       power_2_scale, rowwise, columnwise, m, k)
    launch(
        _cast_transpose_kernel,
        grid,
        x,
        data if data is not None else dummy,
        data_t if data_t is not None else dummy,
        *scalars,
        **flags,
        BLOCK_M=TILE_M,
        BLOCK_K=TILE_K,
        WIDE=needs_wide_offsets(m, k, max(TILE_M, TILE_K)),
        HW_CAST=hw_cast(x),
        PARTIALS_BLOCK=_partials_block(amax, partials),
        num_warps=NUM_WARPS,
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

