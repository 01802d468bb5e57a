"""FP8 block-scaling kernels, DeepSeek style (NUMERICS.md §4): E4M3 elements, 128-long blocks.

Layouts follow numerics/block_fp8.py exactly (compact scale grids, partial edge blocks scaled by
the amax of the elements that exist):
- 1D rowwise: data [M, K], scale_inv [M, ceil(K/128)] (1x128 runs along K);
- 1D columnwise: data [K, M], scale_inv [K, ceil(M/128)] (x^T in 1x128 runs along M);
- 2D: data [M, K], scale_inv [ceil(M/128), ceil(K/128)]; its columnwise copy is the exact
  transpose of both (data [K, M], scale_inv [ceil(K/128), ceil(M/128)]).

Each program owns one aligned 128x128 tile of the [M, K] view, which holds whole blocks of both
directions, so one program writes both copies and the input crosses HBM once: the 1D kernel
takes column maxima (columnwise blocks) and row maxima (rowwise blocks) from the same loads; the
2D kernel takes the tile maximum and stores data and transpose. The tile is swept in 32-wide
chunks to bound registers; where a scale needs the whole tile first (rowwise blocks when both
copies are written, 2D tiles) a second sweep re-reads the tile, which then comes from cache.
Scales follow numerics.scale_from_amax with the input dtype's max as the overflow value
(power-of-2 scales by default).
"""

from __future__ import annotations

import torch

from .fp8_common import (
    abs_bits,
    cdiv,
    dtype_max_bits,
    float32_value,
    fp8_codes,
    hw_cast,
    jit,
    kernel_input,
    needs_wide_offsets,
    reciprocal_rn,
    scale_from_amax,
    tile_offsets,
    tl,
)

BLOCK = 128
# rows or columns per sweep step (bounds registers, see block_1d_tile; CHUNK == BLOCK holds the
# whole tile), and warps. Swept on an H100 with the hardware cast (benchmarks/KERNEL_NOTES.md):
# 1D best at 64-wide chunks with 4 warps, 2D at 64-row chunks with 8 warps.
CHUNK = 32  # the multi-tensor kernel's sweep
CHUNK_1D, NUM_WARPS_1D = 64, 4
CHUNK_2D, NUM_WARPS_2D = 64, 8
ScaledCopies = tuple[
    torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]


@jit
def _load_chunk(x_tile, rows, cols, rows_left, cols_left, K, WIDE: tl.constexpr):
    """Tile-local x[rows, cols] as fp32 (zeros past the tensor's edge) and its mask."""
    mask = (rows[:, None] < rows_left) & (cols[None, :] < cols_left)
    x = tl.load(x_tile + tile_offsets(rows, cols, K, WIDE), mask=mask, other=0.0)
    return x.to(tl.float32), mask


@jit
def _store_columnwise(data_t_tile, codes, rows, cols, rows_left, cols_left, M,
                      WIDE: tl.constexpr):
    """codes[rows, cols] into the transposed [K, M] layout (a register transpose first, so the
    store runs along M and stays coalesced)."""
    mask_t = (cols[:, None] < cols_left) & (rows[None, :] < rows_left)
    tl.store(data_t_tile + tile_offsets(cols, rows, M, WIDE), tl.trans(codes), mask=mask_t)


@jit
def block_1d_tile(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K, pid_m,
                  pid_k, POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                  COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize tile (pid_m, pid_k) of a row-major [M, K] tensor in 1x128 blocks along K
    (ROWWISE) and along M into the transposed layout (COLUMNWISE). Shared with multi_tensor.

    The tile is walked in chunks to bound register use (a whole 128x128 fp32 tile held across a
    reduction spills). A [BLOCK, CHUNK] column chunk holds whole columnwise blocks, a
    [CHUNK, BLOCK] row chunk whole rowwise blocks, so one direction alone is a single sweep.
    Both directions: the column sweep also gathers the row maxima, and a second sweep over the
    same tile, read back from cache rather than HBM, writes the rowwise copy.
    """
    row0 = pid_m.to(tl.int64) * BLOCK
    col0 = pid_k.to(tl.int64) * BLOCK
    rows_left = M - row0
    cols_left = K - col0
    x_tile = x_ptr + row0 * K + col0
    row_tile = row_data_ptr + row0 * K + col0
    col_tile = col_data_ptr + col0 * M + row0
    tile = tl.arange(0, BLOCK)
    chunk = tl.arange(0, CHUNK)
    k_blocks = tl.cdiv(K, BLOCK)
    m_blocks = tl.cdiv(M, BLOCK)
    if CHUNK == BLOCK:
        # whole tile in registers: one load, both maxima, both casts (no re-read)
        x, mask = _load_chunk(x_tile, tile, tile, rows_left, cols_left, K, WIDE)
        magnitude = abs_bits(x)
        if ROWWISE:
            amax = tl.max(magnitude, axis=1).to(tl.float32, bitcast=True)
            scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
            tl.store(row_tile + tile_offsets(tile, tile, K, WIDE),
                     fp8_codes(x * scale[:, None], False, HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + tile) * k_blocks + pid_k, reciprocal_rn(scale),
                     mask=tile < rows_left)
        if COLUMNWISE:
            amax = tl.max(magnitude, axis=0).to(tl.float32, bitcast=True)
            scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
            _store_columnwise(col_tile, fp8_codes(x * scale[None, :], False, HW_CAST), tile,
                              tile, rows_left, cols_left, M, WIDE)
            tl.store(col_si_ptr + (col0 + tile) * m_blocks + pid_m, reciprocal_rn(scale),
                     mask=tile < cols_left)
    elif COLUMNWISE:
        row_amax = tl.zeros([BLOCK], dtype=tl.int32)
        for c in range(BLOCK // CHUNK):
            cols = c * CHUNK + chunk
            x, mask = _load_chunk(x_tile, tile, cols, rows_left, cols_left, K, WIDE)
            magnitude = abs_bits(x)  # zero padding cannot raise an amax; NaN dominates
            if ROWWISE:
                row_amax = tl.maximum(row_amax, tl.max(magnitude, axis=1))
            amax = tl.max(magnitude, axis=0).to(tl.float32, bitcast=True)
            scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
            _store_columnwise(col_tile, fp8_codes(x * scale[None, :], False, HW_CAST), tile, cols,
                              rows_left, cols_left, M, WIDE)
            tl.store(col_si_ptr + (col0 + cols) * m_blocks + pid_m, reciprocal_rn(scale),
                     mask=cols < cols_left)
        if ROWWISE:
            scale = scale_from_amax(row_amax.to(tl.float32, bitcast=True), eps, False, POW2,
                                    OVERFLOW_BITS)
            for c in range(BLOCK // CHUNK):
                cols = c * CHUNK + chunk
                x, mask = _load_chunk(x_tile, tile, cols, rows_left, cols_left, K, WIDE)
                tl.store(row_tile + tile_offsets(tile, cols, K, WIDE),
                         fp8_codes(x * scale[:, None], False, HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + tile) * k_blocks + pid_k, reciprocal_rn(scale),
                     mask=tile < rows_left)
    else:
        for r in range(BLOCK // CHUNK):
            rows = r * CHUNK + chunk
            x, mask = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
            amax = tl.max(abs_bits(x), axis=1).to(tl.float32, bitcast=True)
            scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
            tl.store(row_tile + tile_offsets(rows, tile, K, WIDE),
                     fp8_codes(x * scale[:, None], False, HW_CAST), mask=mask)
            tl.store(row_si_ptr + (row0 + rows) * k_blocks + pid_k, reciprocal_rn(scale),
                     mask=rows < rows_left)


@jit
def _block_1d_kernel(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
                     POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                     COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK)
    block_1d_tile(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
                  pid // tiles_k, pid % tiles_k, POW2, OVERFLOW_BITS, ROWWISE, COLUMNWISE, BLOCK,
                  CHUNK, WIDE, HW_CAST)


@jit
def _block_2d_kernel(x_ptr, row_data_ptr, row_si_ptr, col_data_ptr, col_si_ptr, eps, M, K,
                     POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                     COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     WIDE: tl.constexpr, HW_CAST: tl.constexpr):
    """One scale per 128x128 tile: a sweep for the tile amax, a second (from cache) to cast;
    with CHUNK == BLOCK the whole tile is held in registers (one load)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK)
    tiles_k = tl.cdiv(K, BLOCK)
    pid_m = pid // tiles_k
    pid_k = pid % tiles_k
    row0 = pid_m.to(tl.int64) * BLOCK
    col0 = pid_k.to(tl.int64) * BLOCK
    rows_left = M - row0
    cols_left = K - col0
    x_tile = x_ptr + row0 * K + col0
    tile = tl.arange(0, BLOCK)
    chunk = tl.arange(0, CHUNK)
    if CHUNK == BLOCK:
        x, mask = _load_chunk(x_tile, tile, tile, rows_left, cols_left, K, WIDE)
        amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
        codes = fp8_codes(x * scale, False, HW_CAST)
        if ROWWISE:
            tl.store(row_data_ptr + row0 * K + col0 + tile_offsets(tile, tile, K, WIDE), codes,
                     mask=mask)
        if COLUMNWISE:
            _store_columnwise(col_data_ptr + col0 * M + row0, codes, tile, tile, rows_left,
                              cols_left, M, WIDE)
    else:
        running = tl.zeros([CHUNK, BLOCK], dtype=tl.int32)
        for r in range(BLOCK // CHUNK):
            x, mask = _load_chunk(x_tile, r * CHUNK + chunk, tile, rows_left, cols_left, K, WIDE)
            running = tl.maximum(running, abs_bits(x))
        amax = tl.max(tl.max(running, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, eps, False, POW2, OVERFLOW_BITS)
        for r in range(BLOCK // CHUNK):
            rows = r * CHUNK + chunk
            x, mask = _load_chunk(x_tile, rows, tile, rows_left, cols_left, K, WIDE)
            codes = fp8_codes(x * scale, False, HW_CAST)
            if ROWWISE:
                tl.store(row_data_ptr + row0 * K + col0 + tile_offsets(rows, tile, K, WIDE),
                         codes, mask=mask)
            if COLUMNWISE:
                _store_columnwise(col_data_ptr + col0 * M + row0, codes, rows, tile, rows_left,
                                  cols_left, M, WIDE)
    scale_inv = reciprocal_rn(scale)
    if ROWWISE:
        tl.store(row_si_ptr + pid_m * tiles_k + pid_k, scale_inv)
    if COLUMNWISE:
        tl.store(col_si_ptr + pid_k * tiles_m + pid_m, scale_inv)


def _check(x: torch.Tensor, rowwise: bool, columnwise: bool) -> tuple[int, int]:
    if not kernel_input(x):
        raise ValueError(
            "FP8 block kernels need a non-empty contiguous float32/bfloat16/float16 tensor; got "
            f"dtype {x.dtype}, shape {tuple(x.shape)}, contiguous={x.is_contiguous()}"
        )
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    if not (rowwise or columnwise):
        raise ValueError("FP8 block kernel: ask for the rowwise or the columnwise copy")
    k = x.shape[-1]
    return x.numel() // k, k


def _launch(kernel, x: torch.Tensor, row_grid: tuple[int, int], col_grid: tuple[int, int], *,
            rowwise: bool, columnwise: bool, power_2_scale: bool, amax_epsilon: float,
            chunk: int, num_warps: int) -> ScaledCopies:
    m, k = _check(x, rowwise, columnwise)
    device = x.device

    def buffers(wanted: bool, data_shape: tuple[int, int], grid_shape: tuple[int, int]):
        if not wanted:
            return None, None
        return (torch.empty(data_shape, dtype=torch.uint8, device=device),
                torch.empty(grid_shape, dtype=torch.float32, device=device))

    row_data, row_si = buffers(rowwise, (m, k), row_grid)
    col_data, col_si = buffers(columnwise, (k, m), col_grid)
    present = next(t for t in (row_data, col_data) if t is not None)
    present_si = row_si if row_si is not None else col_si
    grid = (cdiv(m, BLOCK) * cdiv(k, BLOCK),)
    kernel[grid](
        x,
        row_data if row_data is not None else present,
        row_si if row_si is not None else present_si,
        col_data if col_data is not None else present,
        col_si if col_si is not None else present_si,
        float32_value(amax_epsilon),
        m,
        k,
        POW2=power_2_scale,
        OVERFLOW_BITS=dtype_max_bits(x.dtype),
        ROWWISE=rowwise,
        COLUMNWISE=columnwise,
        BLOCK=BLOCK,
        CHUNK=chunk,
        WIDE=needs_wide_offsets(m, k, BLOCK),
        HW_CAST=hw_cast(x),
        num_warps=num_warps,
    )
    e4m3 = torch.float8_e4m3fn
    return (None if row_data is None else row_data.view(e4m3), row_si,
            None if col_data is None else col_data.view(e4m3), col_si)


def quantize_block_1d(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> ScaledCopies:
    """1x128 block FP8 of the [M, K] view of `x`, both directions from one read of the input.

    Returns (rowwise data [M, K], rowwise scale_inv [M, ceil(K/128)], columnwise data [K, M],
    columnwise scale_inv [K, ceil(M/128)]), None for a copy not asked for; bytes equal
    numerics.quantize_block_1d and numerics.quantize_block_1d_columnwise.
    """
    m, k = _check(x, rowwise, columnwise)
    return _launch(_block_1d_kernel, x, (m, cdiv(k, BLOCK)), (k, cdiv(m, BLOCK)),
                   rowwise=rowwise, columnwise=columnwise, power_2_scale=power_2_scale,
                   amax_epsilon=amax_epsilon, chunk=CHUNK_1D, num_warps=NUM_WARPS_1D)


def quantize_block_2d(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> ScaledCopies:
    """128x128 tile FP8 of the [M, K] view of `x`, with the exact transpose as columnwise copy.

    Returns (data [M, K], scale_inv [ceil(M/128), ceil(K/128)], data_t [K, M],
    scale_inv_t [ceil(K/128), ceil(M/128)]), None for a copy not asked for; bytes equal
    numerics.quantize_block_2d and numerics.transpose_block_2d of it.
    """
    m, k = _check(x, rowwise, columnwise)
    tiles_m, tiles_k = cdiv(m, BLOCK), cdiv(k, BLOCK)
    return _launch(_block_2d_kernel, x, (tiles_m, tiles_k), (tiles_k, tiles_m),
                   rowwise=rowwise, columnwise=columnwise, power_2_scale=power_2_scale,
                   amax_epsilon=amax_epsilon, chunk=CHUNK_2D, num_warps=NUM_WARPS_2D)
