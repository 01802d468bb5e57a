"""Recipe state in a module's state dict (`_extra_state`), so a checkpoint resumes exactly
(issue 20).

Why: delayed scaling's amax histories and scales decide what the next step computes. Without
them a resumed model starts its histories afresh and its next outputs differ (by up to 0.30 on
inputs of scale 3 in issue 20's example). TransformerEngine keeps this state in each module's
`_extra_state`; minifloat does the same. The payload holds tensors, lists, strings and ints
only,

    {"format": FORMAT_VERSION, "recipes": [{"recipe": repr(recipe),
                                            "forward": [scale, amax_history],
                                            "backward": [scale, amax_history]}, ...]}

one entry per recipe the module has state for (stateless recipes have none), and the state dict
carries it serialized as one `bytes` value (`encode` / `decode`, read back with
`torch.load(weights_only=True)`, which `torch.load(weights_only=True)` of the whole state dict
also accepts). Why bytes and not the nested dict: torch.distributed.checkpoint flattens nested
containers and loads only the keys the target state dict already has, and a fresh module has no
recipe entries yet, so the state would be dropped; a `bytes` leaf is saved and restored whole
(DCP replaces the target's value). A module learns
its recipe only at the first autocast after loading, so `load_state_dict` keeps the entries
pending, and the first `recipe_states(recipe)` copies the matching entry into the new state
(in place: autocast's update registry keeps its tensors). An entry made under a different recipe
(another history length, format or margin) is an error that names both, never silently
dropped. A checkpoint from before this change has no `_extra_state`: it loads, with a warning
that the histories start afresh.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch

FORMAT_VERSION = 1
EXTRA_STATE_KEY = "_extra_state"


def encode(payload: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def decode(value: Any) -> dict[str, Any] | None:
    """A module's `_extra_state` value (bytes, or the payload itself) -> the payload dict."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, io.BytesIO):
        value = value.getvalue()
    if not isinstance(value, bytes | bytearray):
        raise ValueError(f"_extra_state is not minifloat recipe state ({type(value).__name__}); "
                         "was this checkpoint made by another library?")
    try:
        return torch.load(io.BytesIO(value), weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - any unreadable payload: one clear message
        raise ValueError(f"_extra_state is not minifloat recipe state (unreadable: {error})"
                         ) from None


def recipe_state_dict(recipe_states: dict) -> dict[str, Any]:
    """The `_extra_state` payload of a module: the state tensors of every recipe with some."""
    entries = []
    for recipe, (forward, backward) in recipe_states.items():
        forward_tensors, backward_tensors = forward.state_tensors(), backward.state_tensors()
        if forward_tensors or backward_tensors:
            entries.append({"recipe": repr(recipe),
                            "forward": [t.detach().clone() for t in forward_tensors],
                            "backward": [t.detach().clone() for t in backward_tensors]})
    return {"format": FORMAT_VERSION, "recipes": entries}


def pending_entries(state: Any, module_name: str) -> list[dict]:
    """Check a loaded `_extra_state` and return its entries (to apply at first use)."""
    try:
        state = decode(state)
    except ValueError as error:
        raise ValueError(f"{module_name}: {error}") from None
    if state is None:  # an old checkpoint (see missing_extra_state)
        return []
    if not isinstance(state, dict) or "format" not in state:
        raise ValueError(f"{module_name}: _extra_state is not minifloat recipe state "
                         f"({type(state).__name__}); was this checkpoint made by another library?")
    if state["format"] != FORMAT_VERSION:
        raise ValueError(f"{module_name}: _extra_state has format {state['format']}, this "
                         f"minifloat reads format {FORMAT_VERSION}; load it with the minifloat "
                         "version that saved it")
    return list(state["recipes"])


def apply_pending(entries: list[dict], recipe, forward, backward, module_name: str) -> list[dict]:
    """Copy the entry saved under `recipe` into its new states; the entries left pending.

    A stateful recipe that finds entries of other recipes only raises: the checkpoint was made
    under another recipe, and starting afresh would change what it computes unnoticed."""
    forward_tensors, backward_tensors = forward.state_tensors(), backward.state_tensors()
    if not (forward_tensors or backward_tensors) or not entries:
        return entries
    key = repr(recipe)
    for index, entry in enumerate(entries):
        if entry["recipe"] != key:
            continue
        for name, mine, saved in (("forward", forward_tensors, entry["forward"]),
                                  ("backward", backward_tensors, entry["backward"])):
            if [tuple(t.shape) for t in mine] != [tuple(t.shape) for t in saved]:
                raise ValueError(
                    f"{module_name}: the checkpoint's {name} recipe state has shapes "
                    f"{[tuple(t.shape) for t in saved]}, this module's "
                    f"{[tuple(t.shape) for t in mine]} under the same recipe: the module's "
                    "GEMMs or roles changed since it was saved")
            for target, source in zip(mine, saved, strict=True):
                with torch.no_grad():
                    target.copy_(source)
        return entries[:index] + entries[index + 1:]
    saved = ", ".join(entry["recipe"] for entry in entries)
    raise ValueError(
        f"{module_name}: the checkpoint holds recipe state saved under {saved}, but this module "
        f"now runs under {key} (another history length, format or margin). Train under the "
        "recipe the checkpoint was saved with, or drop the state to start the histories afresh: "
        "module.drop_loaded_recipe_state() (or delete the '_extra_state' entries of the state "
        "dict before loading)")


def missing_extra_state(state_dict: dict, prefix: str, module_name: str) -> None:
    """load_state_dict pre-hook body: a checkpoint without `_extra_state` (made before recipe
    state was saved) loads, with a warning, instead of failing a strict load."""
    key = prefix + EXTRA_STATE_KEY
    if key not in state_dict:
        warnings.warn(f"{module_name or prefix.rstrip('.') or 'module'}: the checkpoint has no "
                      "recipe state (_extra_state; saved before minifloat kept it): delayed-"
                      "scaling amax histories and scales start afresh", stacklevel=4)
        state_dict[key] = None
