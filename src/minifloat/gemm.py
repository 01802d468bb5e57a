"""general_gemm: one entry point for the three GEMMs of a linear layer (DESIGN.md §3-4).

Every operand is given with the copy the GEMM needs: `rowwise` (the tensor as stored, reduction
over its last dim) or `columnwise` (its transpose, reduction over its first dim). The result is
A @ B^T in the TN convention, with A's and B's reduction dims last:

    fprop  Y  = X W^T    general_gemm(x, w)                                     [M, N]
    dgrad  dX = dY W     general_gemm(dy, w, b_columnwise=True)                 [M, K]
    wgrad  dW = dY^T X   general_gemm(dy, x, a_columnwise=True, b_columnwise=True)  [N, K]

Operands may be QuantizedTensors, bare storages or plain tensors, of any two families: a hybrid
operand contributes the sub-storage of the direction asked for, so the two operands of one GEMM
may be e.g. MXFP8 and NVFP4. Pairs with a hardware fast path (CUDA, Hopper): per-tensor FP8 x
per-tensor FP8 (torch._scaled_mm; E4M3/E5M2 on either side, not E5M2 x E5M2) and block FP8
1x128 x 128x128 or 1x128 x 1x128 (torch scaled-mm with block-wise scales). Every other pair
(MXFP8, NVFP4, mixed families, high precision) runs by exact emulation. This module runs the
exact emulation everywhere: both operands decoded exactly (per-tensor factors
kept aside), fp32 accumulation, factors applied after the accumulation, then bias and the output
cast. Fast CUDA paths (per-tensor and block FP8 through torch scaled-mm) plug in behind the same
call and must equal this result up to summation order.
"""

from __future__ import annotations

import torch

from . import gemm_paths, numerics
from .quantizers import IdentityStorage, NVFP4Storage, QuantizedStorage, QuantizedTensor

Operand = torch.Tensor | QuantizedStorage


def _copy_storage(x: Operand, columnwise: bool, label: str) -> QuantizedStorage | None:
    """The storage holding the copy this GEMM reads (a hybrid answers with that direction's
    sub-storage), or None for a plain tensor. Resolved once per operand and call: the dispatch
    below and the decode both take it from here."""
    if isinstance(x, QuantizedStorage):
        storage = x
    elif isinstance(x, QuantizedTensor):
        storage = x._storage
    else:
        return None
    copy = storage.direction_storage(columnwise)  # a hybrid lacking the copy raises here
    if not (storage.has_columnwise() if columnwise else storage.has_rowwise()):
        direction = "columnwise" if columnwise else "rowwise"
        raise ValueError(
            f"general_gemm: operand {label} ({storage!r}) lacks the {direction} copy this "
            f"GEMM needs; quantize it with {direction} usage or call update_usage"
        )
    return copy


def _operand(x: Operand, storage: QuantizedStorage | None, columnwise: bool, label: str
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values [rows, reduction] fp32, optional per-tensor factor) of one operand's copy;
    `storage` is _copy_storage's answer for x."""
    if storage is not None:
        return storage.gemm_operand(columnwise)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"general_gemm: operand {label} must be a tensor, got {type(x).__name__}")
    matrix = x.reshape(-1, x.shape[-1])
    return (matrix.t() if columnwise else matrix), None


def _uses_rht(storage: QuantizedStorage | None, columnwise: bool) -> bool:
    """Whether the copy a GEMM reads (the direction's storage) carries the RHT."""
    return columnwise and isinstance(storage, NVFP4Storage) and storage.with_rht


def _high_precision(storage: QuantizedStorage | None) -> bool:
    """Whether a GEMM operand is not quantized: a plain tensor or an IdentityQuantizer's copy."""
    return storage is None or isinstance(storage, IdentityStorage)


def general_gemm(
    a: Operand,
    b: Operand,
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """A @ B^T with the requested copies; see the module docstring for the three GEMMs.

    out_dtype defaults to the nominal dtype of A. With `accumulate_into` (an fp32 `main_grad`
    of shape [rows(A), rows(B)]) the product is added into it in fp32 and it is returned.
    """
    a_storage = _copy_storage(a, a_columnwise, "A")
    b_storage = _copy_storage(b, b_columnwise, "B")
    # One operand's copy carries the RHT: a high-precision partner (a layer's grad_output or
    # input kept out of quantization, e.g. by the advisor's @hp= spec) gets the same transform
    # here, in fp32, so that it cancels; a quantized partner without it cannot
    transform = None
    if _uses_rht(a_storage, a_columnwise) != _uses_rht(b_storage, b_columnwise):
        transform = "b" if _uses_rht(a_storage, a_columnwise) else "a"
        if not _high_precision(b_storage if transform == "b" else a_storage):
            raise ValueError(
                "general_gemm: only one operand carries the random Hadamard transform, and the "
                "other is quantized without it, so it would not cancel; give both wgrad "
                "operands RHT (NVFP4 inputs and gradients), neither, or keep the other one in "
                "high precision")
    if out_dtype is None:
        out_dtype = a.dtype if isinstance(a, (torch.Tensor, QuantizedStorage)) else torch.float32
    if accumulate_into is not None and accumulate_into.dtype != torch.float32:
        raise TypeError(f"main_grad must be float32 to accumulate into, got "
                        f"{accumulate_into.dtype}")
    path = None if transform else gemm_paths.fast_path(a_storage, a_columnwise, b_storage,
                                                        b_columnwise)
    if path is not None:
        a_values = b_values = a_alpha = b_alpha = None
    else:
        a_values, a_alpha = _operand(a, a_storage, a_columnwise, "A")
        b_values, b_alpha = _operand(b, b_storage, b_columnwise, "B")
        if transform == "a":
            a_values = numerics.random_hadamard_transform(a_values, round_to_bf16=False)
        elif transform == "b":
            b_values = numerics.random_hadamard_transform(b_values, round_to_bf16=False)
        if a_values.shape[1] != b_values.shape[1]:
            raise ValueError(
                f"general_gemm: reduction dims differ: A gives {tuple(a_values.shape)} and B "
                f"gives {tuple(b_values.shape)} (both [rows, reduction])"
            )
        path = gemm_paths.choose_path(a_storage, a_values, b_storage, b_values)
    if accumulate_into is not None:
        if a_values is None:
            rows_a = gemm_paths.operand_dims(a_storage, a_columnwise)[0]
            rows_b = gemm_paths.operand_dims(b_storage, b_columnwise)[0]
        else:
            rows_a, rows_b = a_values.shape[0], b_values.shape[0]
        if tuple(accumulate_into.shape) != (rows_a, rows_b):
            raise ValueError(
                f"general_gemm: main_grad has shape {tuple(accumulate_into.shape)}, the "
                f"product {(rows_a, rows_b)}; give a main_grad shaped like the weight"
            )
    product_dtype = torch.float32 if accumulate_into is not None else out_dtype
    if path == "scaled_mm":
        fprop = not (a_columnwise or b_columnwise)
        product = gemm_paths.scaled_mm_gemm(a_storage, a_columnwise, b_storage, b_columnwise,
                                            out_dtype=product_dtype, bias=bias,
                                            fast_accumulation=fprop)
    elif path == "blockwise_scaled_mm":
        product = gemm_paths.blockwise_scaled_mm_gemm(a_storage, a_columnwise, b_storage,
                                                      b_columnwise, out_dtype=product_dtype,
                                                      bias=bias)
    elif path == "bf16":  # the two factors are multiplied inside the epilogue's pass
        product = gemm_paths.bf16_gemm(a_values, b_values, alpha=a_alpha, alpha2=b_alpha,
                                       bias=bias, out_dtype=product_dtype)
    else:
        product = numerics.emulated_gemm_tn(a_values, b_values,
                                            alpha=gemm_paths.combined_factor(a_alpha, b_alpha),
                                            bias=bias, out_dtype=product_dtype)
    if accumulate_into is not None:
        accumulate_into.add_(product)
        return accumulate_into
    return product
