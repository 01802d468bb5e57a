"""LayerNormLinear: y = norm(x) W^T + b, the norm in high precision and the GEMMs quantized.

The norm (LayerNorm or RMSNorm) runs in torch ops at the input's precision: quantizing before
the statistics would throw away exactly the outliers the norm exists to tame, and its cost is
small next to the GEMMs. Its output then enters the same GEMM path as Linear (run_gemms): it is
quantized once, rowwise for fprop and columnwise for wgrad, and only the columnwise copy is saved
for backward (the norm saves what torch's own autograd saves for it). Roles are Linear's: one
GEMM, named by the module's name.

The norm helpers here are shared with LayerNormMLP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.tensor_parallel import TensorParallelConfig
from .base import QuantizedModule
from .parallel_gemm import parallel_gemm, sequence_parallel_norm_params

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def new_norm_parameters(
    module: nn.Module,
    features: int,
    normalization: str,
    zero_centered_gamma: bool,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> None:
    """Register `layer_norm_weight` (ones; zeros when zero-centered, where gamma = 1 + weight)
    and, for LayerNorm, `layer_norm_bias` (zeros; None for RMSNorm, which has no shift)."""
    fill = 0.0 if zero_centered_gamma else 1.0
    module.layer_norm_weight = nn.Parameter(
        torch.full((features,), fill, dtype=dtype, device=device))
    bias = torch.zeros(features, dtype=dtype, device=device)
    module.layer_norm_bias = nn.Parameter(bias) if normalization == "LayerNorm" else None


def apply_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
) -> torch.Tensor:
    """norm(x) over the last dim, in the dtype of x.

    LayerNorm is F.layer_norm (fp32 statistics inside torch's kernel). RMSNorm is written out,
    in fp32, in this order: x * rsqrt(mean(x^2) + eps), times gamma, cast to x's dtype; torch's
    fused rms_norm kernels differ between devices and versions, explicit ops do not.
    With zero_centered_gamma, gamma = 1 + weight, added in the parameter's dtype (weight decay
    then pulls gamma to 1, not 0).
    """
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    return (normed * gamma.float()).to(x.dtype)


def rows_of(x: torch.Tensor) -> int:
    """Rows of x viewed as [M, K] (an empty input has none)."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


class LayerNormLinear(QuantizedModule):
    """norm -> Linear, with the linear's GEMMs in the autocast recipe's formats.

    Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `weight`, `bias`.
    Outside autocast this is nn.LayerNorm / RMSNorm followed by F.linear (a quantized weight is
    dequantized). With `return_layernorm_output` the forward returns (y, norm(x)), for a
    residual taken after the norm.

    Tensor parallelism as Linear's (TE's arguments), column-parallel only: the norm needs the
    whole feature dimension. Under sequence parallelism the norm runs on the rank's sequence
    shard (its parameters' gradients all-reduced over the group) and its output is gathered.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        tp_amax_reduction: bool = True,
    ) -> None:
        check_normalization(normalization)
        super().__init__(name)
        if parallel_mode == "row":
            raise ValueError("LayerNormLinear is column-parallel or not parallel: a row-parallel "
                             "input is split along the features the norm needs whole; use "
                             "parallel_mode='column', or a norm then a row-parallel Linear")
        self.tp = TensorParallelConfig(tp_group, tp_size, parallel_mode, sequence_parallel,
                                       tp_amax_reduction)
        local_out = (self.tp.shard(out_features, "out_features") if self.tp.active
                     else out_features)
        self.in_features, self.out_features = in_features, out_features
        self.normalization, self.eps = normalization, eps
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        dtype = params_dtype or torch.get_default_dtype()
        new_norm_parameters(self, in_features, normalization, zero_centered_gamma, dtype, device)
        self.weight = self.new_weight(local_out, in_features, dtype, device)
        self.bias = self.new_bias(local_out, in_features, dtype, device) if bias else None

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set (or set again, after unpickling) the tensor-parallel process group."""
        self.tp.set_group(tp_group)

    def _state_device(self) -> torch.device:
        return self.layer_norm_weight.device

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Norm, then the GEMM; `is_first_microbatch` as in TransformerEngine (run_gemms)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"LayerNormLinear expects inputs with last dim {self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        if self.tp.active:
            norm_weight, norm_bias = sequence_parallel_norm_params(
                self.tp, self.layer_norm_weight, self.layer_norm_bias)
            normed = apply_norm(x, norm_weight, norm_bias, self.normalization, self.eps,
                                self.zero_centered_gamma)
            y = parallel_gemm(self, self.tp, "column", normed, self.weight, self.bias, 0,
                              is_first_microbatch)
            return (y, normed) if self.return_layernorm_output else y
        normed = apply_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization,
                            self.eps, self.zero_centered_gamma)
        y = self.run_gemms(normed, [rows_of(normed)], [self.weight], [self.bias], gemms=[0],
                           is_first_microbatch=is_first_microbatch)
        return (y, normed) if self.return_layernorm_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, normalization={self.normalization}, "
                f"eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}, "
                f"name={self.name!r}")
