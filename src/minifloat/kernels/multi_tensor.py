"""Multi-tensor FP8 quantization: many (small) tensors, one kernel launch per phase.

Grouped GEMMs, optimizer master-weight casts and FSDP shards quantize dozens of small tensors;
one launch per tensor would be dominated by launch latency. Here every program of a single grid
finds the tensor it works on in a device table:

- one int64 table per call, uploaded with one asynchronous copy (pinned host memory,
  non_blocking; no host sync): per tensor, its input offset in elements from a base tensor (all
  inputs share one dtype, so the offset is the pointer difference), M, K and its output offsets,
  then the running count of programs owned by the tensors before it;
- a program finds its tensor by binary search over those running counts, then runs the same
  tile code as the single-tensor kernels (per_tensor_tile.per_tensor_tile,
  block_fp8.block_tile), in the load and store modes the host chose for the whole group, so the
  bytes are the single-tensor bytes;
- outputs live in one flat buffer per kind (data, transpose, scales); each tensor's results are
  views into it (16-byte aligned), which keeps the buffer alive while any view is;
- offsets and shapes read from the table carry none of the facts Triton specialises a single
  launch on (16-byte pointers, M and K divisible by 16), and without them every access is
  scalar; `tl.multiple_of` hints restore them, each always true (output offsets) or given only
  when the host found it true of every tensor in the group (_hints).

Per-tensor current scaling runs two launches (amax of every tensor, then every cast), with an
optional amax reduction (e.g. an all-reduce over a group) in between, applied once to the
stacked amaxes. Block FP8 1D needs no amax pass: one launch. multi_tensor_each.py makes each
copy an allocation of its own (the eager weight-cast batch), delayed scaling included, with the
same device code.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from functools import reduce

import torch

from . import per_tensor_fp8
from .block_fp8 import BLOCK, NUM_WARPS_1D, TILE, block_tile, column_major_view, word_view
from .fp8_common import (
    abs_bits,
    cdiv,
    dtype_max_bits,
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
)
from .launch import launch
from .per_tensor_tile import nan_possible, per_tensor_tile
from .stacked_cast import SCALE_SLOT, StackedCast

FIELDS = 8  # int64 entries per tensor in the table (unused ones are 0)
AMAX_BLOCK = 4096
AMAX_STEPS = 4  # loads per amax program: AMAX_BLOCK * AMAX_STEPS elements
ALIGN = 16  # bytes; output views start on 16-byte boundaries
# the same facts in the kernels' terms: data offsets (bytes) and fp32 scale offsets (elements)
DATA_ALIGN = tl.constexpr(ALIGN) if tl is not None else ALIGN
SCALE_ALIGN = tl.constexpr(ALIGN // 4) if tl is not None else ALIGN // 4
# cast tiles: small tensors favour small tiles (more programs); 4 warps keep registers low.
# Groups with a shape whose copies are stored byte by byte take per_tensor_fp8's BYTES_TILE_*.
TILE_M = 64
TILE_K = 64


@jit
def _owner(starts_ptr, pid, n, STEPS: tl.constexpr):
    """Largest i < n with starts[i] <= pid (starts non-decreasing, starts[0] = 0)."""
    lo = pid * 0
    hi = lo + n
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@jit
def _input_pointer(x_base, row, X_DIVISOR: tl.constexpr):
    """This tensor's input pointer; with X_DIVISOR > 1 the host found every input offset a
    multiple of X_DIVISOR elements (16 bytes), so the hint lets 16-byte loads through."""
    offset = tl.load(row)
    if X_DIVISOR > 1:
        offset = tl.multiple_of(offset, X_DIVISOR)
    return x_base + offset


@jit
def _shape(row, WIDE: tl.constexpr, M_ALIGNED: tl.constexpr, K_ALIGNED: tl.constexpr):
    """M, K of this tensor, as the single-tensor launch would pass them: int32 unless WIDE, and
    known multiples of 16 where the host found that true of every tensor in the group (Triton
    specialises a single launch's M, K the same way). Values read from memory carry no
    divisibility facts; without them every access is scalar (sm_90 compile:
    benchmarks/KERNEL_NOTES.md, "multi-tensor alignment hints")."""
    M = tl.load(row + 1)
    K = tl.load(row + 2)
    if not WIDE:
        M = M.to(tl.int32)
        K = K.to(tl.int32)
    if M_ALIGNED:
        M = tl.multiple_of(M, 16)
    if K_ALIGNED:
        K = tl.multiple_of(K, 16)
    return M, K


@jit
def _multi_amax_kernel(x_base, table_ptr, starts_ptr, amax_bits_ptr, n, STEPS: tl.constexpr,
                       FIELDS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                       X_DIVISOR: tl.constexpr, NUMEL_ALIGNED: tl.constexpr):
    """NUMEL_ALIGNED: every tensor's element count is a multiple of 16 (the mask then stays
    constant over a vector, so loads can be 16 bytes wide together with X_DIVISOR)."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    numel = tl.load(row + 1) * tl.load(row + 2)
    if NUMEL_ALIGNED:
        numel = tl.multiple_of(numel, 16)
    x_ptr = _input_pointer(x_base, row, X_DIVISOR)
    first = (pid - tl.load(starts_ptr + i)).to(tl.int64) * (BLOCK * SUB)
    running = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(SUB):
        offsets = first + s * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0)
        running = tl.maximum(running, abs_bits(x))
    tl.atomic_max(amax_bits_ptr + i, tl.max(running, axis=0))


@jit
def _cast_program(table_ptr, starts_ptr, n, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                  BLOCK_K: tl.constexpr, WIDE: tl.constexpr, M_ALIGNED: tl.constexpr,
                  K_ALIGNED: tl.constexpr):
    """What a per-tensor cast program works on: its tensor i, that tensor's table row, M, K,
    the program's index among the tensor's (local) and its tile (row, column)."""
    i = _owner(starts_ptr, tl.program_id(0), n, STEPS)
    row = table_ptr + i * FIELDS
    M, K = _shape(row, WIDE, M_ALIGNED, K_ALIGNED)
    local = (tl.program_id(0) - tl.load(starts_ptr + i)).to(tl.int32)  # < grid size < 2^31
    tiles_k = tl.maximum(tl.cdiv(K, BLOCK_K), 1)  # an empty tensor still owns one program
    return i, row, M, K, local, local // tiles_k, local % tiles_k


@jit
def tile_pointers(x_base, data_base, data_t_base, row, X_DIVISOR: tl.constexpr,
                  HALVES: tl.constexpr, ROW_WORDS: tl.constexpr, COL_WORDS: tl.constexpr):
    """This tensor's input, rowwise and columnwise pointers in the views the words tiles' modes
    take (per_tensor_tile, block_fp8.block_tile): the table's offsets (elements, bytes)
    counted in int64 words of input (HALVES) and int32 words of output (ROW_WORDS, COL_WORDS).
    Output offsets are multiples of ALIGN bytes (_aligned_offsets), so they are hinted
    unconditionally; the input's as the host found."""
    x_offset = tl.load(row)
    if HALVES:
        x_offset = x_offset // 4
    if X_DIVISOR > 1:
        x_offset = tl.multiple_of(x_offset, X_DIVISOR // 4 if HALVES else X_DIVISOR)
    data_offset = tl.load(row + 3) // 4 if ROW_WORDS else tl.load(row + 3)
    data_t_offset = tl.load(row + 4) // 4 if COL_WORDS else tl.load(row + 4)
    data_offset = tl.multiple_of(data_offset, DATA_ALIGN // 4 if ROW_WORDS else DATA_ALIGN)
    data_t_offset = tl.multiple_of(data_t_offset, DATA_ALIGN // 4 if COL_WORDS else DATA_ALIGN)
    return x_base + x_offset, data_base + data_offset, data_t_base + data_t_offset


@jit
def _multi_cast_kernel(x_base, data_base, data_t_base, table_ptr, starts_ptr, amax_ptr,
                       scale_inv_ptr, eps, n, E5M2: tl.constexpr, POW2: tl.constexpr,
                       ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, CHECK_NAN: tl.constexpr,
                       STEPS: tl.constexpr, FIELDS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, HALVES: tl.constexpr, ROW_WORDS: tl.constexpr,
                       COL_WORDS: tl.constexpr, MASK_M: tl.constexpr, MASK_K: tl.constexpr,
                       WIDE: tl.constexpr, HW_CAST: tl.constexpr, PRODUCTS: tl.constexpr,
                       MAX_U16X2: tl.constexpr, X_DIVISOR: tl.constexpr,
                       M_ALIGNED: tl.constexpr, K_ALIGNED: tl.constexpr):
    """Current scaling from each tensor's amax. CHECK_NAN: the amaxes went through a reduction
    that may not carry this tensor's NaN (an all-reduce), so each tile checks its own; else a
    tensor holds a NaN exactly when its amax is NaN."""
    i, row, M, K, local, tile_m, tile_k = _cast_program(
        table_ptr, starts_ptr, n, STEPS, FIELDS, BLOCK_K, WIDE, M_ALIGNED, K_ALIGNED)
    amax = tl.load(amax_ptr + i)
    scale = scale_from_amax(amax, eps, E5M2, POW2, 0x7F7FFFFF)
    x_ptr, data_ptr, data_t_ptr = tile_pointers(x_base, data_base, data_t_base, row, X_DIVISOR,
                                                HALVES, ROW_WORDS, COL_WORDS)
    per_tensor_tile(x_ptr, data_ptr, data_t_ptr, amax_ptr, scale, nan_possible(scale, amax), M,
                    K, tile_m, tile_k, E5M2, ROWWISE, COLUMNWISE, False, CHECK_NAN, BLOCK_M,
                    BLOCK_K, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE, HW_CAST,
                    PRODUCTS, MAX_U16X2)
    if local == 0:
        tl.store(scale_inv_ptr + i * SCALE_ALIGN, reciprocal_rn(scale))  # 16-byte slots


@jit
def _multi_block_1d_kernel(x_base, row_data_base, row_si_base, col_data_base, col_si_base,
                           table_ptr, starts_ptr, eps, n, POW2: tl.constexpr,
                           OVERFLOW_BITS: tl.constexpr, ROWWISE: tl.constexpr,
                           COLUMNWISE: tl.constexpr, STEPS: tl.constexpr, FIELDS: tl.constexpr,
                           HALVES: tl.constexpr, ROW_WORDS: tl.constexpr,
                           COL_WORDS: tl.constexpr, MASK_M: tl.constexpr,
                           MASK_K: tl.constexpr, WIDE: tl.constexpr, HW_CAST: tl.constexpr,
                           MAX_U16X2: tl.constexpr, X_DIVISOR: tl.constexpr,
                           M_ALIGNED: tl.constexpr, K_ALIGNED: tl.constexpr):
    """block_fp8.block_tile on each tensor's tiles. HALVES, ROW_WORDS, COL_WORDS and the masks
    hold for the whole group (the host decides them as quantize_block_1d would for each tensor
    alone, over all of them). Data offsets are multiples of ALIGN bytes and scale offsets of
    ALIGN // 4 floats (_aligned_offsets): hinted unconditionally; the input and M, K as the
    host found. With HALVES the input offsets are counted in int64 words, with ROW_WORDS /
    COL_WORDS the data offsets in int32 words."""
    pid = tl.program_id(0)
    i = _owner(starts_ptr, pid, n, STEPS)
    row = table_ptr + i * FIELDS
    M, K = _shape(row, WIDE, M_ALIGNED, K_ALIGNED)
    M_WORDS = M // 4
    K_WORDS = K // 4
    if M_ALIGNED:
        M_WORDS = tl.multiple_of(M_WORDS, 4)
    if K_ALIGNED:
        K_WORDS = tl.multiple_of(K_WORDS, 4)
    local = (pid - tl.load(starts_ptr + i)).to(tl.int32)  # < grid size < 2^31
    tiles_k = tl.cdiv(K, TILE)
    x_ptr, row_data_ptr, col_data_ptr = tile_pointers(
        x_base, row_data_base, col_data_base, row, X_DIVISOR, HALVES, ROW_WORDS, COL_WORDS)
    row_si_offset = tl.multiple_of(tl.load(row + 5), SCALE_ALIGN)
    col_si_offset = tl.multiple_of(tl.load(row + 6), SCALE_ALIGN)
    block_tile(x_ptr, row_data_ptr, row_si_base + row_si_offset,
               col_data_ptr, col_si_base + col_si_offset, eps, M, K,
               M_WORDS, K_WORDS, local // tiles_k, local % tiles_k, POW2, OVERFLOW_BITS,
               ROWWISE, COLUMNWISE, False, HALVES, ROW_WORDS, COL_WORDS, MASK_M, MASK_K, WIDE,
               HW_CAST, MAX_U16X2)


# ---------------------------------------------------------------------------------------------
# host side: tables and flat output buffers
# ---------------------------------------------------------------------------------------------


def _matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    if t.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    k = t.shape[-1]
    return (t.numel() // k if k else math.prod(t.shape[:-1])), k


def _check_group(tensors: Sequence[torch.Tensor]) -> None:
    if len(tensors) == 0:
        raise ValueError("multi-tensor quantization needs at least one tensor")
    first = tensors[0]
    for t in tensors:
        if t.device != first.device or t.dtype != first.dtype:
            raise ValueError(
                "multi-tensor quantization needs every tensor on one device with one dtype; got "
                f"{t.dtype} on {t.device} next to {first.dtype} on {first.device}: group them "
                "by dtype and device"
            )
        if t.numel() and not kernel_input(t):
            raise ValueError(
                "multi-tensor FP8 kernels need contiguous float32/bfloat16/float16 tensors; got "
                f"dtype {t.dtype}, shape {tuple(t.shape)}, contiguous={t.is_contiguous()}"
            )


def _input_offsets(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A base tensor and each tensor's element offset from it (the kernel's pointer table)."""
    base = next((t for t in tensors if t.numel()), tensors[0])
    size = base.element_size()
    offsets = []
    for t in tensors:
        delta = t.data_ptr() - base.data_ptr() if t.numel() else 0
        if delta % size:
            raise ValueError("multi-tensor quantization: a tensor is not aligned to its dtype")
        offsets.append(delta // size)
    return base, offsets


def _hints(shapes: Sequence[tuple[int, int]], x_offsets: Sequence[int],
           element_size: int) -> dict[str, int | bool]:
    """Divisibility facts true of every tensor in the group, as constexprs for the kernels.

    Triton specialises a single-tensor launch on 16-byte aligned pointers and on M, K divisible
    by 16, and vectorises (16-byte loads and stores, far fewer registers) from those facts; the
    multi kernels read offsets and shapes from the table, so they get the facts only from these
    hints. Each holds for the whole group or is not given (the kernels then take the scalar
    path of before): X_DIVISOR, every input offset a multiple of 16 bytes (in elements; 1 is no
    hint); M_ALIGNED / K_ALIGNED, every M / K a multiple of 16 (zero included). They change
    no bytes, only what the compiler may assume.
    """
    divisor = ALIGN // element_size
    return {
        "X_DIVISOR": divisor if all(offset % divisor == 0 for offset in x_offsets) else 1,
        "M_ALIGNED": all(m % 16 == 0 for m, _ in shapes),
        "K_ALIGNED": all(k % 16 == 0 for _, k in shapes),
    }


def _aligned_offsets(sizes: Sequence[int], align: int) -> tuple[list[int], int]:
    """Start offsets of consecutive regions of `sizes`, each rounded up to `align`; and total."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += cdiv(size, align) * align
    return offsets, total


def _starts(counts: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def _upload(rows: Sequence[Sequence[int]], extra: Sequence[Sequence[int]],
            device: torch.device) -> torch.Tensor:
    """Tables to the device in one asynchronous copy (pinned host memory on CUDA)."""
    values = [v for row in rows for v in (*row, *([0] * (FIELDS - len(row))))]
    for column in extra:
        values.extend(column)
    host = torch.tensor(values, dtype=torch.int64, device="cpu")
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _search_steps(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) + 1


def _view(flat: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
    return flat[offset:offset + shape[0] * shape[1]].view(shape)


def quantize_current_scaling_stacked(
    tensors: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    rowwise: bool = True,
    columnwise: bool = True,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StackedCast:
    """quantize_current_scaling_multi's launches, returning the flat buffers (StackedCast)."""
    if not (rowwise or columnwise):
        raise ValueError("multi-tensor FP8 kernel: ask for the rowwise or the columnwise copy")
    _check_group(tensors)
    device = tensors[0].device
    shapes = [_matrix_shape(t) for t in tensors]
    data_offsets, data_total = _aligned_offsets([m * k for m, k in shapes], ALIGN)
    size = max(data_total, ALIGN)
    data = torch.empty(size, dtype=torch.uint8, device=device) if rowwise else None
    data_t = torch.empty(size, dtype=torch.uint8, device=device) if columnwise else None
    scale_inv = _current_scaling_launches(
        tensors, shapes, fp8_dtype, amax_epsilon, power_2_scale, reduce_amax,
        (data, data_offsets), (data_t, data_offsets))
    return StackedCast(None if data is None else data.view(fp8_dtype),
                       None if data_t is None else data_t.view(fp8_dtype),
                       scale_inv, data_offsets, shapes)


def _cast_plan(shapes: Sequence[tuple[int, int]], base: torch.Tensor,
               x_offsets: Sequence[int]) -> tuple[dict[str, int | bool], list[int]]:
    """The per-tensor cast kernels' constexprs for the whole group, and each tensor's program
    count (its tiles; an empty tensor owns one program, whose accesses must all be masked).

    The tile is TILE_M x TILE_K, or per_tensor_fp8's BYTES_TILE_* where a shape stores bytes.
    The modes are those per_tensor_fp8.tile_modes would give each tensor alone, held only
    where they hold for all (input words also need every offset a whole word), then the
    conversion path and the divisibility hints of _hints, from bitwise ORs of the shapes and
    offsets: this runs on every multi-tensor cast, and a Python pass per fact cost tens of
    microseconds of host time (80 tensors)."""
    divisor = ALIGN // base.element_size()
    rows = [m for m, _ in shapes]
    columns = [k for _, k in shapes]
    # a power of two divides every value exactly when it divides their bitwise OR (negative
    # offsets included: two's complement keeps the low bits)
    m_bits = reduce(operator.or_, rows, 0)
    k_bits = reduce(operator.or_, columns, 0)
    x_bits = reduce(operator.or_, x_offsets, 0)
    words = (m_bits | k_bits) % 4 == 0
    tile_m, tile_k = ((TILE_M, TILE_K) if words
                      else (per_tensor_fp8.BYTES_TILE_M, per_tensor_fp8.BYTES_TILE_K))
    counts = [max(1, cdiv(m, tile_m) * cdiv(k, tile_k)) for m, k in shapes]
    empty = 0 in rows or 0 in columns
    hw = hw_cast(base)
    constexprs = {
        "BLOCK_M": tile_m, "BLOCK_K": tile_k,
        # reads_halves for every tensor: bf16, whole words, 8-byte aligned (the base is, and
        # every offset is a whole number of words)
        "HALVES": (base.dtype == torch.bfloat16 and base.data_ptr() % 8 == 0
                   and (k_bits | x_bits) % 4 == 0),
        "ROW_WORDS": k_bits % 4 == 0, "COL_WORDS": m_bits % 4 == 0,
        "MASK_M": empty or m_bits % tile_m != 0, "MASK_K": empty or k_bits % tile_k != 0,
        "WIDE": needs_wide_offsets(max(rows), max(columns), max(tile_m, tile_k)),
        "HW_CAST": hw, "PRODUCTS": hw or per_tensor_fp8.EMULATE_PRODUCTS,
        "MAX_U16X2": max_u16x2(base), "X_DIVISOR": divisor if x_bits % divisor == 0 else 1,
        "M_ALIGNED": m_bits % 16 == 0, "K_ALIGNED": k_bits % 16 == 0}
    return constexprs, counts


def _current_scaling_launches(
    tensors: Sequence[torch.Tensor],
    shapes: Sequence[tuple[int, int]],
    fp8_dtype: torch.dtype,
    amax_epsilon: float,
    power_2_scale: bool,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None,
    rows_out: tuple[torch.Tensor | None, Sequence[int]],
    columns_out: tuple[torch.Tensor | None, Sequence[int]],
) -> torch.Tensor:
    """The amax launch, the optional reduction and the cast launch, writing each tensor's copies
    at (base, byte offsets) of `rows_out` and `columns_out` (a None base: that copy is not
    made, its offsets unread). Returns the scale_inv buffer, one 16-byte slot per tensor."""
    e5m2 = is_e5m2(fp8_dtype)
    device, n = tensors[0].device, len(tensors)
    sizes = [m * k for m, k in shapes]
    base, x_offsets = _input_offsets(tensors)
    chunk_counts = [cdiv(size, AMAX_BLOCK * AMAX_STEPS) for size in sizes]
    constexprs, tile_counts = _cast_plan(shapes, base, x_offsets)
    (data, data_offsets), (data_t, data_t_offsets) = rows_out, columns_out
    rows = [(x_offsets[i], m, k, data_offsets[i], data_t_offsets[i])
            for i, (m, k) in enumerate(shapes)]
    table = _upload(rows, (_starts(chunk_counts), _starts(tile_counts)), device)
    meta = table[: n * FIELDS]
    chunk_starts = table[n * FIELDS: n * FIELDS + n]
    tile_starts = table[n * FIELDS + n:]
    steps = _search_steps(n)

    amax = torch.zeros(n, dtype=torch.float32, device=device)
    if sum(chunk_counts):
        launch(_multi_amax_kernel, (sum(chunk_counts),),
               base, meta, chunk_starts, amax.view(torch.int32), n, STEPS=steps, FIELDS=FIELDS,
               BLOCK=AMAX_BLOCK, SUB=AMAX_STEPS, X_DIVISOR=constexprs["X_DIVISOR"],
               NUMEL_ALIGNED=all(size % 16 == 0 for size in sizes), num_warps=8)
    if reduce_amax is not None:
        amax = reduce_amax(amax)

    # one 16-byte slot per scale: cuBLAS rejects (CUBLAS_STATUS_NOT_SUPPORTED) an FP8 GEMM whose
    # scale pointer is not 16-byte aligned, and each tensor's scale_inv is a view into this
    scale_inv = torch.empty(n * SCALE_SLOT, dtype=torch.float32, device=device)
    placeholder = data if data is not None else data_t
    # launch(): the compiled kernel's launcher called directly once this specialisation has
    # compiled (Triton's own launch path cost about 80 us a launch in a MoE step's profile)
    x_view, rows_view, cols_view = per_tensor_fp8.tile_views(
        base, data if data is not None else placeholder,
        data_t if data_t is not None else placeholder, constexprs)
    launch(
        _multi_cast_kernel, (sum(tile_counts),),
        x_view,
        rows_view,
        cols_view,
        meta,
        tile_starts,
        amax,
        scale_inv,
        float32_value(amax_epsilon),
        n,
        E5M2=e5m2,
        POW2=power_2_scale,
        ROWWISE=data is not None,
        COLUMNWISE=data_t is not None,
        CHECK_NAN=reduce_amax is not None,
        STEPS=steps,
        FIELDS=FIELDS,
        **constexprs,
        num_warps=4,
    )
    return scale_inv


def quantize_current_scaling_multi(
    tensors: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    rowwise: bool = True,
    columnwise: bool = True,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]]:
    """Per-tensor current scaling of many tensors: one amax launch and one cast launch.

    Each tensor gets its own amax and scale; returns per tensor (data [M, K] or None,
    data_t [K, M] or None, scale_inv [1]), the bytes of per_tensor_fp8.quantize_current_scaling
    (and so of numerics.quantize_current_scaling). `reduce_amax`, when given, maps the stacked
    fp32 amaxes [n] to reduced ones (e.g. an all-reduce MAX over a group) between the launches.
    """
    stacked = quantize_current_scaling_stacked(
        tensors, fp8_dtype, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale,
        rowwise=rowwise, columnwise=columnwise, reduce_amax=reduce_amax)
    return [(None if stacked.data is None else stacked.rowwise(i),
             None if stacked.data_t is None else stacked.columnwise(i),
             stacked.scale(i)) for i in range(len(stacked.shapes))]


def quantize_block_1d_multi(
    tensors: Sequence[torch.Tensor],
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                torch.Tensor | None]]:
    """1x128 block FP8 (E4M3) of many tensors in one launch.

    Returns per tensor (rowwise data [M, K], rowwise scale_inv [M, ceil(K/128)], columnwise
    data [K, M], columnwise scale_inv [K, ceil(M/128)]), None for a copy not asked for; the bytes
    of block_fp8.quantize_block_1d (and so of the numerics reference), the scale grids
    column-major as there.
    """
    if not (rowwise or columnwise):
        raise ValueError("multi-tensor FP8 kernel: ask for the rowwise or the columnwise copy")
    _check_group(tensors)
    device, n = tensors[0].device, len(tensors)
    shapes = [_matrix_shape(t) for t in tensors]
    base, x_offsets = _input_offsets(tensors)
    data_offsets, data_total = _aligned_offsets([m * k for m, k in shapes], ALIGN)
    row_si_offsets, row_si_total = _aligned_offsets(
        [m * cdiv(k, BLOCK) for m, k in shapes], ALIGN // 4)
    col_si_offsets, col_si_total = _aligned_offsets(
        [k * cdiv(m, BLOCK) for m, k in shapes], ALIGN // 4)
    tile_counts = [cdiv(m, BLOCK) * cdiv(k, BLOCK) for m, k in shapes]
    rows = [(x_offsets[i], m, k, data_offsets[i], data_offsets[i], row_si_offsets[i],
             col_si_offsets[i]) for i, (m, k) in enumerate(shapes)]
    table = _upload(rows, (_starts(tile_counts),), device)

    def buffer(wanted: bool, total: int, dtype: torch.dtype) -> torch.Tensor | None:
        return torch.empty(max(total, ALIGN), dtype=dtype, device=device) if wanted else None

    row_data = buffer(rowwise, data_total, torch.uint8)
    row_si = buffer(rowwise, row_si_total, torch.float32)
    col_data = buffer(columnwise, data_total, torch.uint8)
    col_si = buffer(columnwise, col_si_total, torch.float32)
    some_data = row_data if row_data is not None else col_data
    some_si = row_si if row_si is not None else col_si
    if sum(tile_counts):
        # the choices block_fp8.quantize_block_1d makes per tensor, made for the whole group
        halves = (all(reads_halves(base, k) for _, k in shapes)
                  and all(offset % 4 == 0 for offset in x_offsets))
        row_words = all(k % 4 == 0 for _, k in shapes)
        col_words = all(m % 4 == 0 for m, _ in shapes)
        _multi_block_1d_kernel[(sum(tile_counts),)](
            base.view(-1).view(torch.int64) if halves else base,
            word_view(row_data, row_words, some_data),
            row_si if row_si is not None else some_si,
            word_view(col_data, col_words, some_data),
            col_si if col_si is not None else some_si,
            table[: n * FIELDS],
            table[n * FIELDS:],
            float32_value(amax_epsilon),
            n,
            POW2=power_2_scale,
            OVERFLOW_BITS=dtype_max_bits(tensors[0].dtype),
            ROWWISE=rowwise,
            COLUMNWISE=columnwise,
            STEPS=_search_steps(n),
            FIELDS=FIELDS,
            HALVES=halves,
            ROW_WORDS=row_words,
            COL_WORDS=col_words,
            MASK_M=any(m % BLOCK for m, _ in shapes),
            MASK_K=any(k % BLOCK for _, k in shapes),
            WIDE=any(needs_wide_offsets(m, k, BLOCK) for m, k in shapes),
            HW_CAST=hw_cast(tensors[0]),
            MAX_U16X2=max_u16x2(tensors[0]),
            **_hints(shapes, x_offsets, base.element_size()),
            num_warps=NUM_WARPS_1D,
        )
    e4m3 = torch.float8_e4m3fn
    results = []
    for i, (m, k) in enumerate(shapes):
        kb, mb = cdiv(k, BLOCK), cdiv(m, BLOCK)
        results.append((
            None if row_data is None else _view(row_data, data_offsets[i], (m, k)).view(e4m3),
            None if row_si is None else column_major_view(
                row_si[row_si_offsets[i]:row_si_offsets[i] + m * kb], m, kb),
            None if col_data is None else _view(col_data, data_offsets[i], (k, m)).view(e4m3),
            None if col_si is None else column_major_view(
                col_si[col_si_offsets[i]:col_si_offsets[i] + k * mb], k, mb),
        ))
    return results
