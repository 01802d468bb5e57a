"""A tensor-parallel layer's amax reduction for one GEMM call (seed 003: at the point of use).

A TP layer splits some operands across its group's ranks (column-parallel: the weight and the
output gradient; row-parallel: the input and the weight). Formats that scale by a maximum of
the whole tensor (per-tensor FP8 current scaling, NVFP4's global amax) must take that maximum
over every rank's shard, so that each rank's bytes are those of one rank. The reduction lives
on quantizer copies made for the one call (with_amax_group); the quantizers the modules keep
never hold the group.

Under torch.compile the GEMM ops take the reduction as a string, the group's name and the
slots (reduction_key): an op's schema takes no process group. The op resolves the group when
it runs (resolved) and runs the collective inside, as eager does.
"""

from __future__ import annotations

from typing import Any

from ..quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizer,
    NVFP4Quantizer,
    Quantizer,
)
from .linear_function import BACKWARD_SLOTS, FORWARD_SLOTS


def with_amax_group(forward: list[Quantizer], backward: list[Quantizer], group: Any,
                    slots: frozenset[str]) -> tuple[list[Quantizer], list[Quantizer]]:
    """Copies of the named slots' quantizers holding `group` (for this call only)."""

    def with_group(quantizers: list[Quantizer], names: tuple[str, ...]) -> list[Quantizer]:
        result = []
        for index, quantizer in enumerate(quantizers):
            if names[index % len(names)] in slots:
                quantizer = quantizer.copy()
                quantizer.amax_reduction_group = group
            result.append(quantizer)
        return result

    return with_group(forward, FORWARD_SLOTS), with_group(backward, BACKWARD_SLOTS)


def reduction_key(amax_reduction: tuple[Any, frozenset[str]] | None) -> str:
    """A TP amax reduction (group, slot names) as the ops' string argument: "" for none, else
    the group's name and the slots, "name|slot,slot"."""
    if amax_reduction is None:
        return ""
    group, slots = amax_reduction
    return f"{group.group_name}|{','.join(sorted(slots))}"


def resolved(reduction: str) -> tuple[Any, frozenset[str]]:
    """reduction_key undone: (the process group, the slot names)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    name, slots = reduction.split("|")
    return _resolve_process_group(name), frozenset(slots.split(","))


def reduces_split_maxima(forward_prototypes: list[Quantizer],
                         backward_prototypes: list[Quantizer], gemms: list[int],
                         slots: frozenset[str]) -> bool:
    """Whether a TP group's reduction of these GEMMs' slots matters: their quantizers take a
    maximum of the whole tensor (current scaling, NVFP4's global amax; delayed scaling's
    recorded amaxes count too). Block formats (MXFP8, FP8 blocks) take none: their compiled
    ops run as without TP, with the same bytes."""
    quantizers = []
    for gemm in gemms:
        for name in slots:
            if name in FORWARD_SLOTS:
                index = len(FORWARD_SLOTS) * gemm + FORWARD_SLOTS.index(name)
                quantizers.append(forward_prototypes[index])
            else:
                index = len(BACKWARD_SLOTS) * gemm + BACKWARD_SLOTS.index(name)
                quantizers.append(backward_prototypes[index])
    return any(_takes_tensor_maximum(q) for q in quantizers)


def _takes_tensor_maximum(quantizer: Quantizer) -> bool:
    if isinstance(quantizer, HybridQuantizer):
        return (_takes_tensor_maximum(quantizer.rowwise_quantizer)
                or _takes_tensor_maximum(quantizer.columnwise_quantizer))
    return isinstance(quantizer, Float8CurrentScalingQuantizer | Float8Quantizer
                      | NVFP4Quantizer)
