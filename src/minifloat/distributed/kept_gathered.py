"""Whether FSDP2 keeps a weight gathered from forward to backward, read from FSDP2's state.

Why: MXFP8 and hybrid weights gather one direction per all-gather (fsdp.py): the rowwise copy
for forward, the columnwise copy in backward's re-gather, since neither derives the other. A
weight that FSDP2 keeps gathered after forward (`fully_shard(reshard_after_forward=False)`, or
the root module, which FSDP2 does not reshard after forward unless told to) gets no backward
re-gather, so its forward gather must bring both copies.

FSDP2 hands the all-gather hooks the module that owns the weight, not the parameter group
that gathers it. The group is found once per module, by walking the FSDP2 modules of the model
that enable_low_precision_all_gather wrapped (or the owner itself, when it was sharded), and
its `post_forward_mesh_info` is read at each gather: None means no reshard after forward. This
reads FSDP2's private state (torch 2.11 to 2.13: FSDPState._fsdp_param_groups,
FSDPParamGroup.fsdp_params and .post_forward_mesh_info, FSDPParam._module_info). Where that
state is missing, the weight counts as resharded after forward, and a backward that then
finds no columnwise copy says so (modules/linear_function.rebuilt_columnwise).
"""

from __future__ import annotations

import weakref

from torch import nn

# owner module -> the model enable_low_precision_all_gather wrapped (where the walk starts)
_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# owner module -> weak reference to the FSDPParamGroup that gathers its parameters (FSDP2
# gathers a module's parameters in one group)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# owner module -> whether its first gather brought both directions (gathers_both_directions)
_FIRST_ANSWER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_root(owner: nn.Module, root: nn.Module) -> None:
    """Record the model under which `owner`'s FSDP2 parameter group will be found."""
    _ROOTS[owner] = weakref.ref(root)


def gathers_both_directions(owner: nn.Module) -> bool:
    """Whether `owner`'s one-direction-per-gather weights gather both copies at each gather.

    FSDP2 sizes a weight's all-gather buffers at its first gather and keeps them, so the answer
    of the first gather stays: a weight that started with both copies goes on gathering both
    (backward re-gathers too, should reshard_after_forward become True), and one that started
    with one copy a gather cannot start keeping its gathered weights later."""
    first = _FIRST_ANSWER.get(owner)
    kept = kept_gathered_after_forward(owner)
    if first is None:
        _FIRST_ANSWER[owner] = kept
        return kept
    if kept and not first:
        raise RuntimeError(
            f"FSDP2 keeps {getattr(owner, 'name', None) or type(owner).__name__}'s weights "
            "gathered after forward now, but gathered them for one direction a gather before; "
            "FSDP2 keeps the all-gather buffers of a weight's first gather, so MXFP8 and hybrid "
            "weights cannot switch to gathering both copies. Set reshard_after_forward "
            "(fully_shard or set_reshard_after_forward) before the first forward")
    return first


def kept_gathered_after_forward(owner: nn.Module) -> bool:
    """Whether FSDP2 keeps `owner`'s weights gathered from forward to backward (no re-gather)."""
    reference = _GROUPS.get(owner)
    group = reference() if reference is not None else None
    if group is None:
        group = _find_group(owner)
        if group is None:
            return False
        _GROUPS[owner] = weakref.ref(group)
    return group.post_forward_mesh_info is None


def _find_group(owner: nn.Module):
    root_reference = _ROOTS.get(owner)
    root = root_reference() if root_reference is not None else None
    candidates = [owner] + (list(root.modules()) if root is not None else [])
    for module in candidates:
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch before per-parameter meshes: one group a state
            groups = [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                info = getattr(fsdp_param, "_module_info", None)
                if info is not None and info.module is owner:
                    return group
    return None
