"""NVFP4 1D quantization of many tensors in two launches (amax, then cast) instead of two each.

Why: a layer group (experts, a grouped linear, the parameters of a model) holds many small
tensors; launching per tensor costs more than the work. Each program finds the tensor it serves
by a binary search over the tensors' first program indices (one int32 per tensor, built on the
host from shapes only: no device values are read) and its tile from its offset in that tensor,
then runs the same per-tile bodies as kernels.nvfp4, so every tensor gets the bytes its own
`quantize_nvfp4` call (and the numerics reference) would give it. (A table with one row per
tile, built in Python, cost ~7 ms of host time for 16384 tiles: measured on an H200.)

Tables travel to the device through pinned memory with non_blocking copies: no host sync.
Imported lazily, like the other kernel modules, once `minifloat.kernels.available` holds.
"""

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from ..numerics.blocks import as_2d, require_divisible
from .element_cast import kernel_view
from .fp8_common import cdiv, hw_cast
from .multi_tensor import _owner, _search_steps
from .nvfp4 import (
    AMAX_NUM_WARPS,
    BLOCK,
    BLOCK_K,
    BLOCK_M,
    FP_FUSION,
    NUM_WARPS,
    NUM_WARPS_STOCHASTIC,
    amax_tile,
    empty_buffers,
    quantize_1d_tile,
)

# A row of the per-tensor table (int64): addresses of the input, rowwise data, rowwise scale,
# columnwise data, columnwise scale; then M, K and one pad column. The starts table (int32) holds
# each tensor's first program index (an empty tensor owns one program, which writes nothing).
TABLE_WIDTH = tl.constexpr(8)
TORCH_TO_TRITON = {torch.float32: tl.float32, torch.float16: tl.float16, torch.int16: tl.int16}


@triton.jit
def _tile_lookup(tensor_table_ptr, starts_ptr, count, STEPS: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """(tensor index, its row of the tensor table, tile_m, tile_k) of this program: the largest
    index whose first program is <= this one (STEPS halvings of [0, count)), then the tile from
    the program's offset within that tensor, row-major over its tiles."""
    pid = tl.program_id(0)
    lo = _owner(starts_ptr, pid, count, STEPS)
    row = tensor_table_ptr + lo.to(tl.int64) * TABLE_WIDTH
    local = pid - tl.load(starts_ptr + lo)
    tiles_k = tl.maximum(tl.cdiv(tl.load(row + 6), BLOCK_K), 1).to(tl.int32)
    return lo, row, local // tiles_k, local % tiles_k


@triton.jit
def _pointer(row, column, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The address in `column` of a table row as a pointer; ALIGNED: the host found that column
    16-byte aligned in every row (the facts a single-tensor launch gets from Triton's
    specialisation, and without which every load and store is scalar)."""
    pointer = tl.load(row + column).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        # on the pointer itself: the hint does not pass through an int-to-pointer cast
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _shape(row, NARROW: tl.constexpr):
    """M, K as the single-tensor launch passes them: int32 when every M, K fits (NARROW; the
    tile code widens its offsets to int64 itself), and multiples of 16, which quantize_nvfp4_multi
    requires of every tensor (require_divisible), so the hint always holds."""
    M = tl.load(row + 5)
    K = tl.load(row + 6)
    if NARROW:
        M = M.to(tl.int32)
        K = K.to(tl.int32)
    return tl.multiple_of(M, 16), tl.multiple_of(K, 16)


@triton.jit
def _multi_amax_kernel(
    tensor_table_ptr,
    starts_ptr,
    amax_bits_ptr,
    count,
    STEPS: tl.constexpr,
    X_DTYPE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    PLAIN: tl.constexpr,
    RHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    NARROW: tl.constexpr,
):
    """amax_bits[t, 0] / [t, 1]: plain and post-RHT amax bits of tensor t."""
    index, row, tile_m, tile_k = _tile_lookup(tensor_table_ptr, starts_ptr, count, STEPS,
                                               BLOCK_K)
    M, K = _shape(row, NARROW)
    amax_tile(
        _pointer(row, 0, X_DTYPE, X_ALIGNED), amax_bits_ptr + index * 2, M, K, tile_m, tile_k,
        BF16_BITS, PLAIN, RHT, BLOCK_M, BLOCK_K,
    )


@triton.jit
def _multi_1d_kernel(
    tensor_table_ptr,
    starts_ptr,
    row_amax_ptr,
    col_amax_ptr,
    seed_ptr,
    count,
    STEPS: tl.constexpr,
    X_DTYPE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    ROWWISE: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HW: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    OUT_ALIGNED: tl.constexpr,
    NARROW: tl.constexpr,
):
    """Rowwise / columnwise 1x16 NVFP4 of one tile of one tensor; tensor t uses amaxes [t] and
    seeds [t, 0] (rowwise) and [t, 1] (columnwise)."""
    index, row, tile_m, tile_k = _tile_lookup(tensor_table_ptr, starts_ptr, count, STEPS,
                                               BLOCK_K)
    M, K = _shape(row, NARROW)
    u8 = tl.uint8
    quantize_1d_tile(
        _pointer(row, 0, X_DTYPE, X_ALIGNED),
        _pointer(row, 1, u8, OUT_ALIGNED), _pointer(row, 2, u8, OUT_ALIGNED),
        row_amax_ptr + index,
        _pointer(row, 3, u8, OUT_ALIGNED), _pointer(row, 4, u8, OUT_ALIGNED),
        col_amax_ptr + index, seed_ptr + index * 2, M, K, tile_m, tile_k,
        BF16_BITS, ROWWISE, COLUMNWISE, RHT, STOCHASTIC, BLOCK_M, BLOCK_K, HW,
    )


def _to_device(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host table on the device, copied without stalling the host on CUDA."""
    table = torch.tensor(rows, dtype=dtype, device="cpu")
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def quantize_nvfp4_multi(
    xs: Sequence[torch.Tensor],
    *,
    rowwise: bool = True,
    columnwise: bool = False,
    with_rht: bool = False,
    stochastic_rounding: bool = False,
    reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """NVFP4 1D quantization of every tensor in `xs`: a list of the dicts quantize_nvfp4 would
    return for each, from one amax launch and one cast launch.

    All tensors must be contiguous, on one device, of one dtype (float32/bfloat16/float16), with
    M and K multiples of 16. `reduce_amax` is called once per kind of amax (plain, then post-RHT)
    on the vector of all tensors' amaxes, so a reduction group costs one all-reduce, not one per
    tensor (a MAX all-reduce is elementwise). Stochastic rounding draws one seed pair per tensor.
    """
    if not xs:
        return []
    device, dtype = xs[0].device, xs[0].dtype
    views = []
    for x in xs:
        if x.device != device or x.dtype != dtype:
            raise ValueError(
                "quantize_nvfp4_multi needs tensors of one device and dtype; got "
                f"{x.dtype} on {x.device} next to {dtype} on {device}: group them first"
            )
        if not x.is_contiguous():
            raise ValueError("the NVFP4 kernel needs contiguous inputs; call .contiguous() first")
        x2d = as_2d(x)
        require_divisible(tuple(x2d.shape), BLOCK, "NVFP4")
        views.append(x2d)
    reduce_amax = reduce_amax or (lambda amax: amax)
    count = len(views)
    need_plain = rowwise or not with_rht
    need_rht = columnwise and with_rht

    dummy = torch.empty(0, dtype=torch.uint8, device=device)
    outputs, table, starts, programs = [], [], [], 0
    for x2d in views:
        m, k = x2d.shape
        buffers = {}
        if rowwise:
            buffers["rowwise_data"], buffers["rowwise_scale"] = empty_buffers(m, k, device)
        if columnwise:
            buffers["columnwise_data"], buffers["columnwise_scale"] = empty_buffers(k, m, device)
        outputs.append(buffers)
        addresses = [
            buffers.get(name, dummy).data_ptr()
            for name in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
        ]
        table.append([kernel_view(x2d)[0].data_ptr(), *addresses, m, k, 0])
        starts.append(programs)
        programs += max(1, cdiv(m, BLOCK_M) * cdiv(k, BLOCK_K))
    x_view, bf16_bits = kernel_view(views[0])
    x_dtype = TORCH_TO_TRITON[x_view.dtype]
    tensor_table = _to_device(table, torch.int64, device)
    starts_table = _to_device(starts, torch.int32, device)
    # the tables hold raw addresses: keep every buffer alive until both launches are queued
    grid = (programs,)
    steps = _search_steps(count)
    # what Triton would specialise a single-tensor launch on, true here of every tensor
    hints = {
        "X_ALIGNED": all(row[0] % 16 == 0 for row in table),
        "NARROW": all(max(row[5], row[6]) < 2**31 for row in table),
    }
    out_aligned = all(address % 16 == 0 for row in table for address in row[1:5])

    amax_bits = torch.zeros((count, 2), dtype=torch.int32, device=device)
    if programs:
        _multi_amax_kernel[grid](
            tensor_table, starts_table, amax_bits, count, STEPS=steps, X_DTYPE=x_dtype,
            BF16_BITS=bf16_bits,
            PLAIN=need_plain, RHT=need_rht, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, **hints,
            num_warps=AMAX_NUM_WARPS, enable_fp_fusion=FP_FUSION,
        )
    amaxes = amax_bits.view(torch.float32)
    plain = reduce_amax(amaxes[:, 0].contiguous()).float() if need_plain else None
    post_rht = reduce_amax(amaxes[:, 1].contiguous()).float() if need_rht else plain
    row_amax = plain if need_plain else post_rht

    seeds = amax_bits  # not read without stochastic rounding
    if stochastic_rounding:
        seeds = torch.randint(0, 2**62, (count, 2), dtype=torch.int64, device=device)
    if programs and (rowwise or columnwise):
        _multi_1d_kernel[grid](
            tensor_table, starts_table, row_amax, post_rht, seeds, count, STEPS=steps,
            X_DTYPE=x_dtype,
            BF16_BITS=bf16_bits, ROWWISE=rowwise, COLUMNWISE=columnwise, RHT=need_rht,
            STOCHASTIC=stochastic_rounding, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
            HW=hw_cast(views[0]), OUT_ALIGNED=out_aligned, **hints,
            num_warps=NUM_WARPS_STOCHASTIC if stochastic_rounding else NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )

    results = []
    for index, buffers in enumerate(outputs):
        out: dict[str, torch.Tensor] = {}
        if rowwise:
            out["rowwise_data"] = buffers["rowwise_data"]
            out["rowwise_scale"] = buffers["rowwise_scale"].view(torch.float8_e4m3fn)
            out["amax_rowwise"] = plain[index].reshape(1).clone()
        if columnwise:
            out["columnwise_data"] = buffers["columnwise_data"]
            out["columnwise_scale"] = buffers["columnwise_scale"].view(torch.float8_e4m3fn)
            out["amax_columnwise"] = post_rht[index].reshape(1).clone()
        results.append(out)
    return results
