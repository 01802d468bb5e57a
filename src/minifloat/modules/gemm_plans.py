"""The GEMM plans: what the compiled GEMM ops (gemm_op.py) know of a module's recipe.

Why a registry: a custom op takes no Python objects, so a module registers its recipe states and
quantizers once (register_plan) and the ops take the plan's id, an int equal for equal
configurations in every process. Each call rebuilds its quantizers over the call's state
tensors (gemm_call); the prototypes (quantizers without tensors) say what the formats are,
for the decisions made while tracing (which copies backward can rebuild, what a forward carries
to backward, which slots a tensor-parallel group reduces).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ..quantizers import Float8Quantizer, Quantizer
from ..recipe_state import RecipeState
from .input_recast import recasts
from .linear_function import FORWARD_SLOTS, GemmCall
from .tp_reduction import resolved, with_amax_group


@dataclass
class Plan:
    """A configuration shared by modules: prototype states whose quantizers are rebuilt over
    each call's state tensors (or built once when there are none)."""

    forward: RecipeState
    backward: RecipeState
    forward_state_count: int
    stateless: tuple[list[Quantizer], list[Quantizer]] | None
    # the forward quantizers without their tensors: what their types and formats say
    forward_prototypes: list[Quantizer]
    backward_prototypes: list[Quantizer]


PLANS: dict[int, Plan] = {}
def _describe(value: Any, state: list[torch.Tensor]) -> Any:
    """A process-independent description of a quantizer attribute. A tensor the recipe state
    owns is described by its place in `state` (so modules of equal configuration match); any
    other tensor (a custom quantizer's own) by identity, giving that module a plan of its own."""
    if isinstance(value, torch.Tensor):
        base = value._base if value._base is not None else value
        for index, tensor in enumerate(state):
            if base is tensor:
                return ("state", index, value.storage_offset(), tuple(value.shape),
                        str(value.dtype))
        return ("tensor", id(value))
    if isinstance(value, Quantizer):
        skip = ("rowwise_usage", "columnwise_usage", "internal", "amax_reduction_group")
        return (type(value).__qualname__,) + tuple(
            (name, _describe(item, state)) for name, item in sorted(vars(value).items())
            if name not in skip)
    if isinstance(value, list | tuple):
        return tuple(_describe(item, state) for item in value)
    return repr(value)


def register_plan(forward: RecipeState, backward: RecipeState,
                  forward_quantizers: list[Quantizer], backward_quantizers: list[Quantizer]
                  ) -> int:
    """The plan id of a module's recipe states and the quantizers they made; equal
    configurations share one id, in every process."""
    state = forward.state_tensors() + backward.state_tensors()
    signature = repr((repr(forward.recipe), _describe(forward_quantizers, state),
                      _describe(backward_quantizers, state)))
    plan = int.from_bytes(hashlib.sha1(signature.encode()).digest()[:7], "little")
    if plan not in PLANS:
        stateless = None if state else (forward_quantizers, backward_quantizers)
        PLANS[plan] = Plan(forward, backward, len(forward.state_tensors()), stateless,
                             [quantizer_without_tensors(q) for q in forward_quantizers],
                             [quantizer_without_tensors(q) for q in backward_quantizers])
    return plan


def gemm_call(plan_id: int, state: list[torch.Tensor], gemms: list[int], m_splits: list[int],
               need_dgrad: bool, need_wgrad: bool, rebuild: bool = False,
               save_original: bool = False, reduction: str = "") -> GemmCall:
    """The GemmCall of a plan over these state tensors; `reduction` (reduction_key): the
    tensor-parallel group and slots whose quantizer copies reduce their maxima this call."""
    plan = PLANS.get(plan_id)
    if plan is None:
        raise RuntimeError(
            f"minifloat: unknown GEMM plan {plan_id}: a compiled graph from another process "
            "ran before its modules were bound; run one step of the model under autocast first")
    if plan.stateless is not None:
        forward_quantizers, backward_quantizers = plan.stateless
    else:
        forward, _ = plan.forward.with_state_tensors(state[:plan.forward_state_count])
        backward, _ = plan.backward.with_state_tensors(state[plan.forward_state_count:])
        forward_quantizers, backward_quantizers = (forward.make_quantizers(),
                                                   backward.make_quantizers())
    if reduction:
        group, slots = resolved(reduction)
        forward_quantizers, backward_quantizers = with_amax_group(
            forward_quantizers, backward_quantizers, group, slots)
    return GemmCall.from_slots(forward_quantizers, backward_quantizers, gemms, m_splits,
                               need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                               rebuild_weights=rebuild, save_original_input=save_original)


def slot_quantizers(plan_id: int, gemms: list[int], slot: int) -> list[Quantizer]:
    """The tensor-less forward quantizers of slot `slot` (0 input, 1 weight) of these GEMMs."""
    prototypes = PLANS[plan_id].forward_prototypes
    return [prototypes[len(FORWARD_SLOTS) * gemm + slot] for gemm in gemms]


def _delayed(quantizers: list[Quantizer]) -> bool:
    return all(type(q) is Float8Quantizer for q in quantizers)


def rebuild_applies(plan_id: int, gemms: list[int]) -> bool:
    """Whether the compiled ops can make these GEMMs' weight copies in backward: stateless
    recipes, and plain delayed scaling, whose forward scales the forward op hands to backward
    (the recipe state's are updated in between). Other stateful weights keep their copies."""
    return PLANS[plan_id].stateless is not None or _delayed(slot_quantizers(plan_id, gemms, 1))


def save_original_applies(plan_id: int, gemms: list[int]) -> bool:
    """Whether the compiled backward can make these GEMMs' input copy itself (input_recast)."""
    quantizers = slot_quantizers(plan_id, gemms, 0)
    return recasts(quantizers) and (PLANS[plan_id].stateless is not None
                                    or _delayed(quantizers))


def carried_counts(plan_id: int, gemms: list[int], need_dgrad: bool, need_wgrad: bool,
                    rebuild: bool, save_original: bool) -> tuple[int, int]:
    """How many delayed-scaling scales the forward op returns after the kept buffers: one per
    weight it keeps no copy of, and (scale, scale_inv) of an input it keeps no copy of."""
    weights = (len(gemms) if rebuild and need_dgrad
               and _delayed(slot_quantizers(plan_id, gemms, 1)) else 0)
    inputs = (2 if save_original and need_wgrad
              and _delayed(slot_quantizers(plan_id, gemms, 0)) else 0)
    return weights, inputs


def quantizer_without_tensors(quantizer: Quantizer) -> Quantizer:
    clone = quantizer.copy()
    for name, value in vars(clone).items():
        if isinstance(value, torch.Tensor):
            setattr(clone, name, None)
        elif isinstance(value, Quantizer):
            setattr(clone, name, quantizer_without_tensors(value))
    return clone
