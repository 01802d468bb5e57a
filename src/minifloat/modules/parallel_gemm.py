"""One GEMM of a module under tensor (and sequence) parallelism: the collectives around
run_gemms, shared by Linear, LayerNormLinear and LayerNormMLP (see
distributed/tensor_parallel.py for the layout and the amax reduction)."""

from __future__ import annotations

import torch

from ..autocast import active_token
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
                  is_first_microbatch: bool | None) -> torch.Tensor:
    """x W^T + b for this rank's shard of W, split by `mode` ("column" or "row").

    Column: the input is replicated (identity forward, all-reduced gradient) or, under
    sequence parallelism, gathered along dim 0; the local bias is added in the GEMM. Row: the
    partial products are all-reduced, or reduce-scattered along dim 0 under sequence
    parallelism, then the whole bias is added once.
    """
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return parallel_gemms(module, tp, mode, x, [rows], [weight], [bias], [gemm],
                          is_first_microbatch)


def parallel_gemms(module: QuantizedModule, tp: TensorParallelConfig, mode: str,
                   x: torch.Tensor, m_splits: list[int], weights: list[torch.Tensor],
                   biases: list[torch.Tensor | None], gemms: list[int],
                   is_first_microbatch: bool | None) -> torch.Tensor:
    """parallel_gemm over row splits, GEMM i on rows split i (GroupedLinear's experts, each
    weight this rank's shard of that expert's)."""
    group = tp.require_group(module.name or type(module).__name__)
    gather_group = None
    if mode == "column" and tp.sequence_parallel and len(weights) == 1 and (
            module.gather_input_quantized(gemms[0], x.numel() // x.shape[-1])):
        gather_group = group  # the rows gathered as FP8 bytes inside the GEMM call
    elif mode == "column":
        x = gather_along_sequence(x, group) if tp.sequence_parallel else (
            copy_to_tensor_parallel(x, group))
        if tp.sequence_parallel:  # the gathered rows: the whole sequence
            m_splits = [x.numel() // x.shape[-1] if x.shape[-1] else 0]
    # a sequence-parallel row layer scatters inside the GEMM call, so that backward can
    # gather the output gradient as FP8 bytes (eager; the compiled path maps in autograd)
    scatter_group = (group if mode == "row" and tp.sequence_parallel and len(weights) == 1
                     and active_token() != 0 and not torch.compiler.is_compiling() else None)
    reduction = (group, _SPLIT_OPERANDS[mode]) if tp.amax_reduction else None
    y = module.run_gemms(x, m_splits, weights,
                         biases if mode == "column" else [None] * len(weights), gemms=gemms,
                         is_first_microbatch=is_first_microbatch, amax_reduction=reduction,
                         input_gather_group=gather_group, output_scatter_group=scatter_group)
    if mode == "column":
        return y
    if not tp.sequence_parallel:
        y = reduce_from_tensor_parallel(y, group)
        return y if biases[0] is None else y + _row_biases(biases, m_splits, y)
    if scatter_group is None:
        y = reduce_scatter_along_sequence(y, group)
    # each rank adds the bias to its own rows: the bias gradient sums over the group
    return y if biases[0] is None else y + copy_to_tensor_parallel(biases[0], group)


def _row_biases(biases: list[torch.Tensor], m_splits: list[int], y: torch.Tensor
                ) -> torch.Tensor:
    """Each split's bias broadcast over its rows (one bias: itself)."""
    if len(biases) == 1:
        return biases[0]
    rows = torch.cat([bias.expand(count, -1) for bias, count in zip(biases, m_splits,
                                                                     strict=True)])
    return rows.reshape(y.shape)


def sequence_parallel_norm_params(tp: TensorParallelConfig, *params: torch.Tensor | None
                                  ) -> list[torch.Tensor | None]:
    """Norm parameters as used on a rank's sequence shard: their gradients are partial sums
    over the rank's rows, so under sequence parallelism they are all-reduced over the group
    (identity forward)."""
    if not tp.sequence_parallel:
        return list(params)
    group = tp.require_group("a sequence-parallel norm")
    return [None if p is None else copy_to_tensor_parallel(p, group) for p in params]
