"""Tensor and sequence parallelism for minifloat modules (issue 17), on torch.distributed.

The modules take TransformerEngine's arguments (`tp_group`, `tp_size`, `parallel_mode`,
`sequence_parallel`); `in_features` and `out_features` are the global sizes and each rank holds
its shard of the weight:

- column-parallel: the weight's output features are split, W_r = W[r * N/tp : (r+1) * N/tp].
  The input is replicated (or, under sequence parallelism, gathered along dim 0 from the
  ranks' sequence shards); each rank computes its slice of the output. Backward all-reduces
  the input gradient (or reduce-scatters it along the sequence).
- row-parallel: the input features are split, W_r = W[:, r * K/tp : (r+1) * K/tp]; the input
  is the rank's feature slice (a column-parallel layer's output); the partial products are
  all-reduced (or reduce-scattered along the sequence), then the bias is added once (under
  sequence parallelism to each rank's rows, so its gradient is all-reduced over the group).

The collectives are autograd functions over the group's torch.distributed calls, Megatron's
mappings (`copy_to_tensor_parallel`, `reduce_from_tensor_parallel`, `gather_along_sequence`,
`reduce_scatter_along_sequence`).

Quantization runs on the local operands. A local shard of a per-tensor format has its own amax,
so with `tp_amax_reduction` (the default) the operands split across ranks (column: the weight
and the output gradient; row: the input and the weight) get the amax all-reduced over the TP
group for that one quantize call (seed 003: a throwaway quantizer copy holds the group), which
gives every rank the bytes of the single-rank run. Block formats need no reduction when the
split falls on block boundaries. Under sequence parallelism a per-tensor FP8 input is gathered
as its one-byte codes, a block format (MXFP8, 1x128 blocks, NVFP4) as the codes and scales of
its copies where no block crosses a rank (and a row-parallel layer's output gradient likewise in
backward: sequence_gather.py);
other formats gather in high precision and quantize the gathered tensor whole. Either way the
bytes are those of one rank.

Under torch.compile (fullgraph) the layers trace with their collectives. The amax reduction
runs in the graph where the casts are traced (FP8 current scaling under graph_casts: functional
collectives) and inside the GEMM ops otherwise (current scaling, NVFP4's global amax: the op
resolves the group from its name, tp_reduction.reduction_key); block formats have no tensor
maximum to reduce, and delayed scaling's histories are reduced by autocast as in eager.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

PARALLEL_MODES = (None, "column", "row")
# torch 2.13 renamed the single-tensor collectives (the old names warn); torch 2.11 has only those
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Under torch.compile the collectives below are the functional ones (a new tensor out, waited
# on), not the in-place calls that dynamo rewrites: on torch 2.11 with NCCL the rewritten
# in-place reduce-scatter in an autograd.Function's backward returned zeros (a compiled
# sequence-parallel layer's input gradient; measured on 2 x H200, eager and CPU gloo right).
_TRACED_REDUCE_SCATTER = (getattr(funcol, "reduce_scatter_single", None)
                          or funcol.reduce_scatter_tensor)
# gloo reduce-scatters from torch 2.13 (the release that renamed the collectives); before it,
# a gloo group all-reduces and keeps its slice
_GLOO_REDUCE_SCATTERS = hasattr(dist, "reduce_scatter_single")


def _world(group: Any) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))
    out = x.new_empty((_world(group) * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = _world(group)
    if x.shape[0] % world:
        raise ValueError(
            f"sequence parallelism splits dim 0 over the {world} ranks of the TP group; the "
            f"tensor has {x.shape[0]} rows there (pad the sequence to a multiple of {world})")
    x = x.contiguous()
    if dist.get_backend(group) == "gloo" and not _GLOO_REDUCE_SCATTERS:
        total = _all_reduce(x, group)
        rank = dist.get_rank(group)
        rows = x.shape[0] // world
        return total[rank * rows:(rank + 1) * rows].clone()
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(_TRACED_REDUCE_SCATTER(x, "sum", 0, group))
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _REDUCE_SCATTER(out, x, group=group)
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity; backward: all-reduce (the input of column-parallel layers)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce; backward: identity (the output of row-parallel layers)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlongSequence(torch.autograd.Function):
    """Forward: all-gather along dim 0; backward: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterAlongSequence(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0; backward: all-gather along dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


def gather_along_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherAlongSequence.apply(x, group)


def reduce_scatter_along_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceScatterAlongSequence.apply(x, group)


class TensorParallelConfig:
    """A module's TP settings; the group is set at construction or by
    set_tensor_parallel_group, and never pickled (a process group does not survive it)."""

    def __init__(self, tp_group: Any = None, tp_size: int = 1, parallel_mode: str | None = None,
                 sequence_parallel: bool = False, tp_amax_reduction: bool = True) -> None:
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be 'column', 'row' or None, got "
                             f"{parallel_mode!r}")
        if tp_group is not None:
            tp_size = _world(tp_group)
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if sequence_parallel and parallel_mode is None:
            raise ValueError("sequence_parallel needs parallel_mode 'column' or 'row'")
        self.group = tp_group
        self.size = tp_size
        self.mode = parallel_mode if tp_size > 1 else None
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.amax_reduction = tp_amax_reduction
        self._lost_group = False

    @property
    def active(self) -> bool:
        return self.mode is not None

    def set_group(self, group: Any) -> None:
        size = _world(group)
        if self.size > 1 and size != self.size:
            raise ValueError(f"the module was built for tp_size {self.size}; the group has "
                             f"{size} ranks")
        self.group, self._lost_group = group, False

    def require_group(self, owner: str) -> Any:
        if self.group is None:
            why = ("it was pickled, which drops process groups" if self._lost_group
                   else "none was given")
            raise RuntimeError(
                f"{owner} is {self.mode}-parallel over {self.size} ranks but has no tp_group "
                f"({why}); call module.set_tensor_parallel_group(group)")
        return self.group

    def shard(self, count: int, what: str) -> int:
        if count % self.size:
            raise ValueError(f"{what} = {count} does not split over tp_size {self.size}; use a "
                             f"multiple of {self.size}")
        return count // self.size

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_lost_group"] = state["group"] is not None or state["_lost_group"]
        state["group"] = None
        return state
