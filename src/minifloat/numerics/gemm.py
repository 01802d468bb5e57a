"""The exact emulated GEMM: the reference every fast GEMM path is compared with.

Operands arrive dequantized (exactly: every format's dequantized values are representable in fp32,
and for MXFP8 and NVFP4 blocks in bf16). The product accumulates in fp32; per-tensor factors that
a hardware kernel applies in its epilogue (NVFP4's S_dec of each operand) are applied after the
accumulation as one fp32 alpha, then the result is cast to the output dtype.
"""

from __future__ import annotations

import torch


def emulated_gemm_tn(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out = alpha * (a @ b^T) + bias for a [M, K] and b [N, K], in fp32, cast to out_dtype.

    "TN" is the cuBLAS convention both operands follow here: each is stored with the reduction
    dim K last, which is how rowwise data of an input and of a weight are laid out.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"emulated_gemm_tn needs a [M, K] and b [N, K] with the same K; got "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    out = torch.matmul(a.float(), b.float().t())
    if alpha is not None:
        out = out * alpha.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
