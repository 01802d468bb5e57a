"""Fast GEMM paths on CUDA, each equal to the exact emulation up to summation order.

general_gemm picks one per call from the two operands' formats (DESIGN.md §4):

- "scaled_mm": both operands per-tensor FP8 (not both E5M2, which cuBLAS lacks), dims multiples
  of 16: torch._scaled_mm on the FP8 bytes, scale_inv of each operand as its scale, fast
  accumulation for fprop only (dgrad and wgrad accumulate in full fp32, as the recipes specify).
- "blockwise_scaled_mm": block FP8 with A in 1x128 blocks and B in 1x128 blocks or 128x128 tiles
  (fprop x.W, dgrad dY.W^T, wgrad dY^T.X of Float8BlockScaling), every dim a multiple of 128:
  torch.nn.functional.scaled_mm with BlockWise scaling; scales in the layout torch checks
  (1x128 grids column-major; 128x128 grids padded to a multiple of 4 along K/128, transposed).
- "bf16": every decoded value of both operands is a bf16 number, so a bf16 GEMM with fp32
  accumulation and fp32 output (torch.mm(out_dtype=float32)) multiplies exactly what the
  emulation multiplies: per-tensor FP8 values, MXFP8 (E4M3/E5M2 x E8M0; exact while a block's
  scale is at least 2^-118, i.e. for any tensor whose blocks are not all below ~1e-35), NVFP4
  blocks (E2M1 x UE4M3, always exact), power-of-2-scaled block FP8, bf16 high-precision operands.
  Per-tensor factors (NVFP4's S_dec) are applied to the fp32 product, then bias and the cast,
  in one pass over the product (kernels/epilogue.py).
- "fp32": the emulation as written (numerics.emulated_gemm_tn); the path everywhere else and on
  every device other than CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .quantizers import (
    Float8BlockStorage,
    Float8Storage,
    IdentityStorage,
    MXFP8Storage,
    NVFP4Storage,
    QuantizedStorage,
)
from .quantizers.base import kernel_module

_BF16_EXACT = (Float8Storage, MXFP8Storage, NVFP4Storage)


def _bf16_exact(storage: QuantizedStorage | None, values: torch.Tensor) -> bool:
    """Whether every value of this operand is a bf16 number (decided by format, no data pass)."""
    if storage is None or isinstance(storage, IdentityStorage):
        return values.dtype == torch.bfloat16
    if isinstance(storage, _BF16_EXACT):
        return True
    if isinstance(storage, Float8BlockStorage):
        return bool(getattr(storage.quantizer, "power_2_scale", False))
    return False


def operand_dims(storage: QuantizedStorage, columnwise: bool) -> tuple[int, int]:
    """(rows, reduction) of one copy: [M, K] rowwise, [K, M] columnwise."""
    m, k = storage.matrix_shape
    return (k, m) if columnwise else (m, k)


def _on_cuda(storage: QuantizedStorage) -> bool:
    return storage.device.type == "cuda"


def scaled_mm_applies(
    a: QuantizedStorage | None, a_columnwise: bool, b: QuantizedStorage | None,
    b_columnwise: bool,
) -> bool:
    """Both per-tensor FP8 on CUDA, not both E5M2, every dim a multiple of 16, same reduction."""
    if not (isinstance(a, Float8Storage) and isinstance(b, Float8Storage)):
        return False
    if a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2 or not _on_cuda(a):
        return False
    rows_a, reduction = operand_dims(a, a_columnwise)
    rows_b, reduction_b = operand_dims(b, b_columnwise)
    return reduction == reduction_b and all(n % 16 == 0 for n in (rows_a, reduction, rows_b))


# torch.nn.functional.scaled_mm with BlockWise scaling types (newer torch); fixed per process
_HAS_BLOCKWISE_SCALED_MM = hasattr(F, "ScalingType")


def blockwise_scaled_mm_applies(
    a: QuantizedStorage | None, a_columnwise: bool, b: QuantizedStorage | None,
    b_columnwise: bool,
) -> bool:
    """Block FP8 on CUDA, A 1D, every dim a multiple of 128, same reduction."""
    if not (isinstance(a, Float8BlockStorage) and isinstance(b, Float8BlockStorage)):
        return False
    if a.block_scaling_dim != 1 or not _HAS_BLOCKWISE_SCALED_MM or not _on_cuda(a):
        return False
    rows_a, reduction = operand_dims(a, a_columnwise)
    rows_b, reduction_b = operand_dims(b, b_columnwise)
    return reduction == reduction_b and all(n % 128 == 0 for n in (rows_a, reduction, rows_b))


def fast_path(
    a: QuantizedStorage | None, a_columnwise: bool, b: QuantizedStorage | None,
    b_columnwise: bool,
) -> str | None:
    """"scaled_mm", "blockwise_scaled_mm" or None (decode and emulate) for the copies a GEMM
    reads. One family test per call: only per-tensor and block FP8 storages have a fast path,
    so every other pair (and every plain tensor) answers None without the shape arithmetic."""
    if isinstance(a, Float8Storage):
        return "scaled_mm" if scaled_mm_applies(a, a_columnwise, b, b_columnwise) else None
    if isinstance(a, Float8BlockStorage):
        return ("blockwise_scaled_mm"
                if blockwise_scaled_mm_applies(a, a_columnwise, b, b_columnwise) else None)
    return None


def _column_major(grid: torch.Tensor) -> torch.Tensor:
    """The grid with stride 1 along its rows: no copy for the 1D kernels' grids, which are
    written so (kernels/block_fp8.py)."""
    return grid.t().contiguous().t()


def _tile_grid_operand(grid: torch.Tensor) -> torch.Tensor:
    """A 128x128 tile grid [N/128, K/128] as BlockWise128x128 reads it: [K/128, N/128] with its
    leading dimension a multiple of 4 (stride (1, ceil4(K/128))). A contiguous grid whose K/128
    is a multiple of 4 already is one, transposed: no copy (F.pad copies even a zero pad)."""
    padded = -(-grid.shape[1] // 4) * 4
    if padded != grid.shape[1] or not grid.is_contiguous():
        grid = F.pad(grid, (0, padded - grid.shape[1])).contiguous()
    return grid.t()


def blockwise_scaled_mm_gemm(
    a: Float8BlockStorage,
    a_columnwise: bool,
    b: Float8BlockStorage,
    b_columnwise: bool,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A @ B^T on block FP8 bytes through torch.nn.functional.scaled_mm (BlockWise scaling)."""
    kinds = F.ScalingType
    a_data = a.columnwise_data if a_columnwise else a.rowwise_data
    a_scale = a.columnwise_scale_inv if a_columnwise else a.rowwise_scale_inv
    b_data = b.columnwise_data if b_columnwise else b.rowwise_data
    b_scale = b.columnwise_scale_inv if b_columnwise else b.rowwise_scale_inv
    if b.block_scaling_dim == 2:
        b_scale = _tile_grid_operand(b_scale)
        b_kind = kinds.BlockWise128x128
    else:
        b_scale = _column_major(b_scale)
        b_kind = kinds.BlockWise1x128
    gemm_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
    # cuBLASLt takes A row-major and B^T column-major only: a copy gathered under sequence
    # parallelism may be a strided view (no copy when the bytes are already contiguous)
    out = F.scaled_mm(
        a_data.contiguous(), b_data.contiguous().t(), _column_major(a_scale.float()),
        kinds.BlockWise1x128,
        b_scale.float(), b_kind, output_dtype=torch.float32 if bias is not None else gemm_dtype,
    )
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def choose_path(
    a: QuantizedStorage | None, a_values: torch.Tensor, b: QuantizedStorage | None,
    b_values: torch.Tensor,
) -> str:
    """"bf16" or "fp32" for decoded operands (scaled_mm is decided before decoding)."""
    if not a_values.is_cuda:
        return "fp32"
    if _bf16_exact(a, a_values) and _bf16_exact(b, b_values):
        return "bf16"
    return "fp32"


def _fp32(scale: torch.Tensor) -> torch.Tensor:
    """A 1-element scale as fp32 at a 16-byte aligned address, as cuBLAS's FP8 GEMM needs (it
    answers CUBLAS_STATUS_NOT_SUPPORTED otherwise); the kernels' scale_inv already is both (no
    op then: host time), a view into a packed scale buffer may not be (one tiny copy)."""
    if scale.dtype != torch.float32:
        return scale.float()
    if kernels.is_fake(scale) or torch.compiler.is_compiling():
        return scale  # tracing (torch.compile): no address to check (graph_casts.py's scales
        #               are per_tensor_scales outputs, buffers of their own)
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def scaled_mm_gemm(
    a: Float8Storage,
    a_columnwise: bool,
    b: Float8Storage,
    b_columnwise: bool,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accumulation: bool,
) -> torch.Tensor:
    """A @ B^T on the FP8 bytes through torch._scaled_mm (TN: A row-major, B^T column-major)."""
    return scaled_mm_bytes(a.data_transpose if a_columnwise else a.data,
                           b.data_transpose if b_columnwise else b.data, a.scale_inv,
                           b.scale_inv, out_dtype=out_dtype, bias=bias,
                           fast_accumulation=fast_accumulation)


def scaled_mm_bytes(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_inv_a: torch.Tensor,
    scale_inv_b: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accumulation: bool,
) -> torch.Tensor:
    """mat_a @ mat_b^T for FP8 bytes [M, K] and [N, K] with their per-tensor scale_inv: the one
    torch._scaled_mm call of scaled_mm_gemm, also made by the lean FP8 path (modules/lean_fp8.py)
    so that both give the same bytes."""
    scaled_mm_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16,
                                                 torch.float32) else torch.float32
    use_bias = bias is not None and bias.dtype == scaled_mm_dtype == torch.bfloat16
    out = torch._scaled_mm(
        mat_a, mat_b.t(), scale_a=_fp32(scale_inv_a), scale_b=_fp32(scale_inv_b),
        bias=bias if use_bias else None,
        out_dtype=torch.float32 if (bias is not None and not use_bias) else scaled_mm_dtype,
        use_fast_accum=fast_accumulation,
    )
    if bias is not None and not use_bias:
        out = out + bias.float()
    return out if out.dtype == out_dtype else out.to(out_dtype)


def combined_factor(alpha: torch.Tensor | None, alpha2: torch.Tensor | None
                    ) -> torch.Tensor | None:
    """A GEMM's per-tensor factor from its two operands' (None where an operand has none): their
    product in fp32, as the emulation applies it after the accumulation."""
    if alpha is None:
        return None if alpha2 is None else alpha2.float()
    return alpha.float() if alpha2 is None else alpha.float() * alpha2.float()


def bf16_gemm(
    a_values: torch.Tensor,
    b_values: torch.Tensor,
    *,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    alpha2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The emulation with bf16 operands (exact conversions) and fp32 accumulation and output.
    alpha and alpha2: the operands' per-tensor factors (None: none), multiplied in fp32 as the
    emulation multiplies them, inside the epilogue's one pass where the kernels run."""
    if alpha is None and alpha2 is None and bias is None and out_dtype == torch.bfloat16:
        # cuBLAS accumulates in fp32 and rounds once to bf16: the emulation's own last step
        return torch.mm(a_values.to(torch.bfloat16), b_values.to(torch.bfloat16).t())
    product = torch.mm(a_values.to(torch.bfloat16), b_values.to(torch.bfloat16).t(),
                       out_dtype=torch.float32)
    if kernels.available(product) and out_dtype in (torch.bfloat16, torch.float16,
                                                    torch.float32):
        epilogue = kernel_module("epilogue")  # Triton: fast path only
        return epilogue.scale_bias_cast(product, alpha, bias, out_dtype, alpha2=alpha2)
    alpha = combined_factor(alpha, alpha2)
    if alpha is not None:
        product = product * alpha
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)
