"""Grouped FP8 GEMMs whose groups are given by device-side offsets (a mixture of experts).

Why a kernel of minifloat's own: torch._scaled_grouped_mm takes E4M3 operands only on sm90,
and the HYBRID recipes quantize gradients to E5M2, so a MoE layer's dgrad and wgrad had no
grouped kernel and ran one _scaled_mm per expert, which needs every expert's row count on the
host (a synchronisation per layer, and no torch.compile graph). These kernels read the groups'
row ends from device memory, take any pair of E4M3/E5M2 operands (Triton's fp8 dot permits
every combination on sm90) and apply each group's per-tensor scales in the epilogue.

Layout contract (modules/grouped_offsets.py builds it): the rows of group g are
[ends[g-1], ends[g]) with ends[-1] = 0, every end a multiple of GROUP_ROWS (128), so a block of
BLOCK_M <= 128 rows never straddles two groups; rows from ends[E-1] on belong to no group.

- `grouped_rows_gemm`: out[r, :] = (a[r, :] @ b[g]^T) * a_scale[g] * b_scale[g] for r in group
  g (a [R, D], b [E, W, D]: the forward x W_g^T and the dgrad dy W_g = dy (W_g^T)^T); rows of
  no group are written as zeros.
- `grouped_reduction_gemm`: out[g] = (a[:, rows g] @ b[:, rows g]^T) * a_scale[g] * b_scale[g]
  (a [W1, R], b [W2, R]: the wgrad dy_g^T x_g from the columnwise copies); an empty group's
  result is zeros.

Accumulation: fp32. `precise=False` lets sm90's FP8 MMA accumulate at its own precision
(cuBLAS' fast accumulation, the forward's setting); `precise=True` promotes each
SPLIT_ACCUMULATION-deep (128) partial sum to the fp32 accumulator, whatever BLOCK_K (the split
accumulator the backward GEMMs use; every 32 cost the dgrad 40% more time on an H200).

The operands may also be fp16 holding exact values (NVFP4's blocks, E2M1 x UE4M3: the NVFP4
experts, modules/grouped_offsets_nvfp4.py), the scales then the operands' global decode scales:
the fp32 sum times a_scale * b_scale, one rounding, is the emulated NVFP4 GEMM (NUMERICS.md §6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch

GROUP_ROWS = 128  # every group's row count is a multiple of this (the layout contract)
# the split accumulator's depth: precise GEMMs promote every this many products to fp32
# (a 256-deep block then makes two promotions: the numerics do not follow the tiles)
SPLIT_ACCUMULATION = 128
_GROUP_ROWS = tl.constexpr(GROUP_ROWS)
_OUT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def group_of_block(ends_ptr, start, GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr):
    """The group holding row `start` (GROUPS when it is past the last group's end)."""
    index = tl.arange(0, GROUPS_POW2)
    ends = tl.load(ends_ptr + index, mask=index < GROUPS, other=0x7FFFFFFF)
    return tl.sum((ends <= start).to(tl.int32), axis=0)


@triton.jit
def _accumulate(a, b, acc, PRECISE: tl.constexpr, PROMOTE_K: tl.constexpr):
    """acc + a @ b^T: with PRECISE, each PROMOTE_K-deep partial sum promoted to fp32 apart."""
    if PRECISE:
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE_K)
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _banded_block(pid, m_blocks, n_blocks, GROUP_M: tl.constexpr):
    """The (row block, column block) of program `pid` in bands of GROUP_M row blocks: down each
    band's column blocks, the band's row blocks innermost (ROWS_GROUP_M says why). With
    GROUP_M 1, row-major order: every column block of row block 0, then of row block 1, ..."""
    in_band = GROUP_M * n_blocks
    first_m = (pid // in_band) * GROUP_M
    band_rows = tl.minimum(m_blocks - first_m, GROUP_M)  # the last band may be shorter
    return first_m + (pid % in_band) % band_rows, (pid % in_band) // band_rows


@triton.jit
def _rows_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, ends_ptr, rows, width, depth,
                 stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_om, stride_on,
                 GROUPS: tl.constexpr, GROUPS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr,
                 PROMOTE_K: tl.constexpr, OUT_TYPE: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _banded_block(tl.program_id(0), tl.cdiv(rows, BLOCK_M),
                                 tl.cdiv(width, BLOCK_N), GROUP_M)
    start = pid_m * BLOCK_M
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = (offs_m[:, None] < rows) & (offs_n[None, :] < width)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    group = group_of_block(ends_ptr, start, GROUPS, GROUPS_POW2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if group < GROUPS:  # else rows of no group: zeros
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = (b_ptr + group.to(tl.int64) * stride_bg + offs_n[:, None] * stride_bn
                  + offs_k[None, :] * stride_bk)
        for k in range(0, depth, BLOCK_K):
            k_mask = offs_k[None, :] < depth - k
            a = tl.load(a_ptrs, mask=k_mask, other=0.0)
            b = tl.load(b_ptrs, mask=(offs_n[:, None] < width) & k_mask, other=0.0)
            acc = _accumulate(a, b, acc, PRECISE, PROMOTE_K)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        acc = acc * (tl.load(a_scale_ptr + group) * tl.load(b_scale_ptr + group))
    tl.store(out_ptrs, acc.to(OUT_TYPE), mask=out_mask)


@triton.jit
def _reduction_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, ends_ptr, width_a,
                      width_b, stride_ai, stride_ar, stride_bj, stride_br, stride_og, stride_oi,
                      stride_oj, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISE: tl.constexpr, PROMOTE_K: tl.constexpr,
                      OUT_TYPE: tl.constexpr, GROUP_MAJOR: tl.constexpr,
                      GROUP_M: tl.constexpr):
    if GROUP_MAJOR:  # the blocks of one group run together (REDUCTION_GROUP_MAJOR)
        pid, group = tl.program_id(0), tl.program_id(1)
    else:
        group, pid = tl.program_id(0), tl.program_id(1)
    pid_m, pid_n = _banded_block(pid, tl.cdiv(width_a, BLOCK_M), tl.cdiv(width_b, BLOCK_N),
                                 GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # the group's rows start and end on GROUP_ROWS: said to the compiler, so that it loads
    # whole 16-byte vectors along them (without it, an H200 ran this kernel at 21 TFLOP/s)
    first = tl.multiple_of(tl.load(ends_ptr + group - 1, mask=group > 0, other=0), _GROUP_ROWS)
    last = tl.multiple_of(tl.load(ends_ptr + group), _GROUP_ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_ai + (first + offs_k)[None, :] * stride_ar
    b_ptrs = b_ptr + offs_n[:, None] * stride_bj + (first + offs_k)[None, :] * stride_br
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # whole BLOCK_K steps: every group's row count is a multiple of GROUP_ROWS >= BLOCK_K
    for _ in range(first, last, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < width_a, other=0.0)
        b = tl.load(b_ptrs, mask=offs_n[:, None] < width_b, other=0.0)
        acc = _accumulate(a, b, acc, PRECISE, PROMOTE_K)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
    alpha = tl.load(a_scale_ptr + group) * tl.load(b_scale_ptr + group)
    # an empty group's sum is zero whatever its scales hold
    result = tl.where(last > first, acc * alpha, 0.0)
    out_ptrs = (out_ptr + group.to(tl.int64) * stride_og + offs_m[:, None] * stride_oi
                + offs_n[None, :] * stride_oj)
    tl.store(out_ptrs, result.to(OUT_TYPE),
             mask=(offs_m[:, None] < width_a) & (offs_n[None, :] < width_b))


# Launch order of the rows kernel's output blocks: bands of this many row blocks, each band's
# column blocks in turn with its row blocks innermost. In row-major order (1) the blocks that
# run at once share one row block of the input but read as many distinct column blocks of the
# expert's weight, and the next row block reads them again: at Mixtral 8x7B's widths (a
# gate_up weight of 117 MB an expert in FP8, more than L2) every weight byte comes from memory
# once per row block by that count, 16 times an expert at 2048 rows, about what the kernel's
# 784 TFLOP/s there suggests (BENCHMARKS.md, twenty-ninth session). In bands of 8, a wave of
# 132 blocks reads 8 row blocks and about 16 column blocks, each from L2 after its first read.
ROWS_GROUP_M = 8

# Launch order of the wgrad's output blocks: with the groups outermost, the blocks that run at
# once share one group's operands in L2 (a wave of 132 blocks reads one group's [W2, rows]
# operand and 8 row blocks of the other); with the groups innermost, a wave reads every group's
# (the first version's order). grouped_gemm_bench.py --sweep times both: on an H100 at
# Mixtral-style shapes, outermost ran 1.27x (gate_up) and 1.30x (down) faster (BENCHMARKS.md).
REDUCTION_GROUP_MAJOR = True
# Within a group, the wgrad's output blocks in bands too (ROWS_GROUP_M's order): row-major, a
# wave of the down projection's wgrad at 8x7B's widths (dy^T 4096 x rows against x^T 14336 x
# rows) spans one row block and all 112 column blocks, so every wave reads the group's whole
# x^T (29 MB at 2048 rows) again, from L2 at best; in bands of 8, about 6 MB a wave.
REDUCTION_GROUP_M = 8


def _tiles(device: torch.device, stages: int, element_size: int = 1) -> dict[str, int]:
    """Block sizes and launch settings: 128 x 128 x 128 with 8 warps on a GPU (64 deep for
    2-byte operands, the same shared memory a stage), `stages` deep
    (benchmarks/grouped_gemm_bench.py --sweep on an H200 at Mixtral-style shapes: 3 fastest
    for the fast-accumulating forward; for the split-accumulating backward GEMMs 4 beat 3 in
    one call, and 3-5 fell within the sweep's noise in the next), small blocks under the
    interpreter (the CPU tests)."""
    if device.type == "cuda":
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128 // element_size, num_warps=8,
                    num_stages=stages)
    return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)


def _reduction_tiles(device: torch.device, element_size: int = 1) -> dict[str, int]:
    """The wgrad kernel's tiles: _tiles' backward setting (its own function, so that
    grouped_gemm_bench.py --sweep can time other blocks for it alone: its output dims are free
    of the layout contract, which bounds only its BLOCK_K). On an H100 at Mixtral-style shapes
    3 to 5 stages timed alike, and 16-warp 128x256 or 256x128 blocks 1.5x slower."""
    return _tiles(device, 4, element_size)


def grouped_rows_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                      b_scale_inv: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype,
                      *, precise: bool) -> torch.Tensor:
    """out [R, W] in out_dtype (module docstring). a [R, D] and b [E, W, D] FP8 (any strides),
    scales fp32 [E], ends int32 [E]."""
    rows, depth = a.shape
    groups, width = b.shape[0], b.shape[1]
    out = torch.empty(rows, width, dtype=out_dtype, device=a.device)
    tiles = _tiles(a.device, 4 if precise else 3, a.element_size())
    if GROUP_ROWS % tiles["BLOCK_M"]:
        raise ValueError(
            f"grouped_rows_gemm: BLOCK_M {tiles['BLOCK_M']} does not divide GROUP_ROWS "
            f"({GROUP_ROWS}): a block of rows would straddle two groups and take the first "
            "one's weight. Use a BLOCK_M that divides GROUP_ROWS.")
    stages = tiles.pop("num_stages")
    warps = tiles.pop("num_warps")
    grid = (triton.cdiv(rows, tiles["BLOCK_M"]) * triton.cdiv(width, tiles["BLOCK_N"]),)
    launch(_rows_kernel, grid, a, b, out, a_scale_inv, b_scale_inv, ends, rows, width, depth,
           a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
           out.stride(1), num_warps=warps, options=dict(num_stages=stages), GROUPS=groups,
           GROUPS_POW2=triton.next_power_of_2(groups), **tiles, PRECISE=precise,
           PROMOTE_K=min(tiles["BLOCK_K"], SPLIT_ACCUMULATION),
           OUT_TYPE=_OUT_TYPES[out_dtype], GROUP_M=ROWS_GROUP_M)
    return out


def grouped_reduction_gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor,
                           b_scale_inv: torch.Tensor, ends: torch.Tensor,
                           out_dtype: torch.dtype, *, precise: bool) -> torch.Tensor:
    """out [E, W1, W2] in out_dtype (module docstring). a [W1, R] and b [W2, R] FP8 (any
    strides), scales fp32 [E], ends int32 [E]."""
    width_a, width_b, groups = a.shape[0], b.shape[0], ends.shape[0]
    out = torch.empty(groups, width_a, width_b, dtype=out_dtype, device=a.device)
    tiles = _reduction_tiles(a.device, a.element_size())
    if GROUP_ROWS % tiles["BLOCK_K"]:
        raise ValueError(
            f"grouped_reduction_gemm: BLOCK_K {tiles['BLOCK_K']} does not divide GROUP_ROWS "
            f"({GROUP_ROWS}): the kernel steps through each group's rows BLOCK_K at a time, so "
            "its last block would read the next group's rows (or past the buffer). Use a "
            "BLOCK_K that divides GROUP_ROWS.")
    stages = tiles.pop("num_stages")
    warps = tiles.pop("num_warps")
    blocks = triton.cdiv(width_a, tiles["BLOCK_M"]) * triton.cdiv(width_b, tiles["BLOCK_N"])
    grid = (blocks, groups) if REDUCTION_GROUP_MAJOR else (groups, blocks)
    launch(_reduction_kernel, grid, a, b, out, a_scale_inv, b_scale_inv, ends, width_a,
           width_b, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
           out.stride(1), out.stride(2), num_warps=warps, options=dict(num_stages=stages),
           **tiles, PRECISE=precise, PROMOTE_K=min(tiles["BLOCK_K"], SPLIT_ACCUMULATION),
           OUT_TYPE=_OUT_TYPES[out_dtype],
           GROUP_MAJOR=REDUCTION_GROUP_MAJOR, GROUP_M=REDUCTION_GROUP_M)
    return out
