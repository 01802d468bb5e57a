"""GroupedLinear: one Linear per expert over row splits of one input (mixture of experts).

`forward(x, m_splits)` takes the token count of each expert: rows [sum(m[:i]), sum(m[:i+1])) of
x go through weight i. Splits may be uneven or empty (an expert without tokens contributes no
rows and a zero weight gradient). Every split's operands are quantized in one split_quantize
call, with a quantizer per expert (its own scale), and the GEMMs run per expert. Under
per-tensor FP8 (current or delayed scaling) without biases, with every split a multiple of 16
rows (TransformerEngine's own rule for FP8 grouped GEMMs), the GEMMs take the lean grouped
path (lean_grouped_fp8.py: one grouped FP8 GEMM in forward on an H100/H200).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..distributed.tensor_parallel import TensorParallelConfig
from ..quantizers.split import check_splits
from . import lean_grouped_fp8
from .base import QuantizedModule
from .lean_grouped_fp8 import LeanGroupedFP8
from .parallel_gemm import parallel_gemms


def init_expert_parameters(
    module: QuantizedModule,
    num_gemms: int,
    in_features: int,
    out_features: int,
    bias: bool,
    params_dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> None:
    """Register weight0..weight{G-1} and bias0..bias{G-1} (shared by the module and the op)."""
    if num_gemms < 1:
        raise ValueError(f"GroupedLinear needs num_gemms >= 1, got {num_gemms}")
    module.num_gemms = num_gemms
    module.in_features, module.out_features = in_features, out_features
    module.use_bias = bias
    dtype = params_dtype or torch.get_default_dtype()
    for gemm in range(num_gemms):
        module.register_parameter(
            f"weight{gemm}", module.new_weight(out_features, in_features, dtype, device, gemm))
        module.register_parameter(
            f"bias{gemm}",
            module.new_bias(out_features, in_features, dtype, device) if bias else None)


class ExpertParameters:
    """The per-expert parameter lists of a module or op built by init_expert_parameters."""

    num_gemms: int

    @property
    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{gemm}") for gemm in range(self.num_gemms)]

    @property
    def biases(self) -> list[torch.Tensor | None]:
        return [getattr(self, f"bias{gemm}") for gemm in range(self.num_gemms)]


class GroupedLinear(ExpertParameters, QuantizedModule):
    """`num_gemms` linear layers of shape [out_features, in_features] applied to row splits.

    Parameters are weight0..weight{G-1} and bias0..bias{G-1}. Roles have module_type
    "grouped_linear" and the module's name for every expert.

    Tensor parallelism as Linear's (TE's arguments), each expert's weight split alike
    ("column": output features, "row": input features); no sequence parallelism (the row
    splits count a rank's tokens per expert; experts shard over ranks by expert parallelism).
    `save_original_input` as Linear's.
    """

    module_type = "grouped_linear"

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        tp_amax_reduction: bool = True,
        save_original_input: bool = False,
    ) -> None:
        super().__init__(name)
        self.save_original_input = save_original_input
        self.tp = TensorParallelConfig(tp_group, tp_size, parallel_mode, False,
                                       tp_amax_reduction)
        local_out, local_in = out_features, in_features
        if self.tp.mode == "column":
            local_out = self.tp.shard(out_features, "out_features")
        elif self.tp.mode == "row":
            local_in = self.tp.shard(in_features, "in_features")
        init_expert_parameters(self, num_gemms, local_in, local_out, bias, params_dtype,
                               device)
        if self.tp.mode == "row" and bias:  # whole biases, added once after the reduction
            dtype = params_dtype or torch.get_default_dtype()
            for gemm in range(num_gemms):
                setattr(self, f"bias{gemm}",
                        self.new_bias(out_features, in_features, dtype, device))
        self.in_features, self.out_features = in_features, out_features
        # (recipe token, first GEMM) -> (binding, lean grouped plan or None)
        self._grouped_plans: dict[tuple[int, int], tuple] = {}

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set (or set again, after unpickling) the tensor-parallel process group."""
        self.tp.set_group(tp_group)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int],
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        """y[rows of expert i] = x[rows of expert i] W_i^T + b_i; `is_first_microbatch` as in
        TransformerEngine (see QuantizedModule.run_gemms)."""
        features = self.in_features // self.tp.size if self.tp.mode == "row" else (
            self.in_features)
        if x.shape[-1] != features:
            raise ValueError(f"GroupedLinear expects inputs with last dim {features}, got "
                             f"shape {tuple(x.shape)}")
        splits = check_splits(x.numel() // features if features else 0, m_splits,
                              self.num_gemms)
        if self.tp.active:
            return parallel_gemms(self, self.tp, self.tp.mode, x, splits, self.weights,
                                  self.biases, list(range(self.num_gemms)),
                                  is_first_microbatch)
        if is_first_microbatch is None and not self.use_bias:
            plan = lean_grouped_fp8.module_plan(self, 0, self.num_gemms)
            x2d = x.reshape(-1, features)
            weights = tuple(self.weights)
            if plan is not None and lean_grouped_fp8.applies(x2d, weights, splits):
                grad = torch.is_grad_enabled()
                y = LeanGroupedFP8.apply(x2d, tuple(splits), plan, grad and x.requires_grad,
                                         grad and any(w.requires_grad for w in weights),
                                         *weights)
                return y.reshape(*x.shape[:-1], self.out_features)
        return self.run_gemms(x, splits, self.weights, self.biases,
                              gemms=list(range(self.num_gemms)),
                              is_first_microbatch=is_first_microbatch)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, name={self.name!r}")
