"""Linear: y = x W^T + b with every GEMM operand quantized by the active recipe.

Forward quantizes the input rowwise (plus columnwise when the weight needs a gradient) and the
weight rowwise (plus columnwise when the input needs a gradient), and saves only what backward
uses: the input's columnwise copy and the weight's columnwise copy. Backward quantizes dY in the
directions its two GEMMs need (DESIGN.md §3). The GEMMs live in linear_function.py, shared with
GroupedLinear.
"""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.tensor_parallel import TensorParallelConfig
from .base import QuantizedModule
from .parallel_gemm import parallel_gemm


class Linear(QuantizedModule):
    """A drop-in nn.Linear whose GEMMs run in the autocast recipe's formats.

    Outside autocast it is an ordinary linear layer (a quantized weight is dequantized).
    With `weight.main_grad` (an fp32 tensor set by a distributed optimizer) wgrad accumulates
    into it and `weight.grad` stays None.

    Tensor parallelism (TransformerEngine's arguments, distributed/tensor_parallel.py):
    `parallel_mode` "column" splits the output features over the `tp_group` (or `tp_size`
    ranks, the group set later with set_tensor_parallel_group), "row" the input features;
    in_features and out_features stay the global sizes and the weight is this rank's shard.
    `sequence_parallel` gathers a column-parallel layer's input along dim 0 (and
    reduce-scatters a row-parallel layer's output). `tp_amax_reduction` reduces the amax of
    the split operands of per-tensor formats over the group, so that the bytes are the
    single-rank run's; without it each shard is scaled by its own amax.

    `save_original_input` (TransformerEngine's argument) keeps the high-precision input for the
    weight gradient instead of its quantized columnwise copy (QuantizedModule's attribute of
    that name says when it saves memory).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        name: str | None = None,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        tp_amax_reduction: bool = True,
        save_original_input: bool = False,
    ) -> None:
        super().__init__(name)
        self.save_original_input = save_original_input
        self.in_features, self.out_features = in_features, out_features
        self.tp = TensorParallelConfig(tp_group, tp_size, parallel_mode, sequence_parallel,
                                       tp_amax_reduction)
        local_out, local_in = out_features, in_features
        if self.tp.mode == "column":
            local_out = self.tp.shard(out_features, "out_features")
        elif self.tp.mode == "row":
            local_in = self.tp.shard(in_features, "in_features")
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = self.new_weight(local_out, local_in, dtype, device)
        # row-parallel: the whole bias, added once after the reduction
        self.bias = self.new_bias(local_out if self.tp.mode == "column" else out_features,
                                  in_features, dtype, device) if bias else None

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set (or set again, after unpickling) the tensor-parallel process group."""
        self.tp.set_group(tp_group)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """y = x W^T + b; `is_first_microbatch` as in TransformerEngine (see run_gemms)."""
        if not self.tp.active:
            rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
            return self.run_gemms(x, [rows], [self.weight], [self.bias], gemms=[0],
                                  is_first_microbatch=is_first_microbatch)
        return parallel_gemm(self, self.tp, self.tp.mode, x, self.weight, self.bias, 0,
                             is_first_microbatch)

    def extra_repr(self) -> str:
        tp = (f", parallel_mode={self.tp.mode!r}, tp_size={self.tp.size}, "
              f"sequence_parallel={self.tp.sequence_parallel}" if self.tp.active else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}{tp}")
