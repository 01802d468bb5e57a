"""One GEMM of a module under tensor (and sequence) parallelism: the collectives around
run_gemms, shared by Linear, LayerNormLinear and LayerNormMLP (see
distributed/tensor_parallel.py for the layout and the amax reduction)."""

from __future__ import annotations

import torch

from ..distributed.tensor_parallel import (
    TensorParallelConfig,
    copy_to_tensor_parallel,
    gather_along_sequence,
    reduce_from_tensor_parallel,
    reduce_scatter_along_sequence,
)
from .base import QuantizedModule

# the operands a rank holds only a shard of, whose per-tensor amax is reduced over the group
_SPLIT_OPERANDS = {"column": frozenset({"weight", "grad_output"}),
                   "row": frozenset({"input", "weight"})}


def parallel_gemm(module: QuantizedModule, tp: TensorParallelConfig, mode: str,
                  x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: int,
                  is_first_microbatch: bool | None, *, gather_input: bool = True,
                  reduce_output: bool = True) -> torch.Tensor:
    """x W^T + b for this rank's shard of W, split by `mode` ("column" or "row").

    Column: the input is replicated (identity forward, all-reduced gradient) or, under
    sequence parallelism, gathered along dim 0 (`gather_input=False`: the caller gathered it);
    the local bias is added in the GEMM. Row: the partial products are all-reduced, or
    reduce-scattered along dim 0 under sequence parallelism (`reduce_output=False`: left
    partial for the caller), then the whole bias is added once.
    """
    group = tp.require_group(module.name or type(module).__name__)
    if mode == "column" and gather_input:
        x = gather_along_sequence(x, group) if tp.sequence_parallel else (
            copy_to_tensor_parallel(x, group))
    reduction = (group, _SPLIT_OPERANDS[mode]) if tp.amax_reduction else None
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    y = module.run_gemms(x, [rows], [weight], [bias if mode == "column" else None],
                         gemms=[gemm], is_first_microbatch=is_first_microbatch,
                         amax_reduction=reduction)
    if mode == "column" or not reduce_output:
        return y
    if not tp.sequence_parallel:
        y = reduce_from_tensor_parallel(y, group)
        return y if bias is None else y + bias
    y = reduce_scatter_along_sequence(y, group)
    # each rank adds the bias to its own rows: the bias gradient sums over the group
    return y if bias is None else y + copy_to_tensor_parallel(bias, group)


def sequence_parallel_norm_params(tp: TensorParallelConfig, *params: torch.Tensor | None
                                  ) -> list[torch.Tensor | None]:
    """Norm parameters as used on a rank's sequence shard: their gradients are partial sums
    over the rank's rows, so under sequence parallelism they are all-reduced over the group
    (identity forward)."""
    if not tp.sequence_parallel:
        return list(params)
    group = tp.require_group("a sequence-parallel norm")
    return [None if p is None else copy_to_tensor_parallel(p, group) for p in params]
