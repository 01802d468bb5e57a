"""Resumable comparison runs (issue 19): each recipe's run checkpoints itself after every
evaluation, and a comparison started again over the same folder with the same settings picks
each run up at its last checkpoint, finishing bit for bit as the uninterrupted run (CPU).

A checkpoint (OUT/checkpoints/<recipe>.pt, the last one only) holds what the next step reads:
the model's parameters, the optimizer's state, the batch generator's and the global RNG's
states (NVFP4's stochastic rounding and the Hadamard signs draw from it), the recipe's state
tensors (delayed scaling's scales and amax histories, with the last backward update applied:
autocast would apply it at the next entry), the curves so far and the timing totals. It is
written with torch.save and read with weights_only=True: tensors, lists and numbers only.

A checkpoint made under other settings (preset, steps, seed, lr, recipe...) is not resumed:
the run starts afresh and says so.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..autocast import update_delayed_backward_scales
from ..recipes import Recipe

FORMAT_VERSION = 1


def checkpoint_path(out_dir: Path, label: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", label)
    return out_dir / "checkpoints" / f"{safe}.pt"


def recipe_tensors(model: nn.Module, recipe: Recipe | None) -> list[torch.Tensor]:
    """The recipe's state tensors of every minifloat module, in module order."""
    if recipe is None:
        return []
    return [tensor for module in model.modules() if hasattr(module, "recipe_states")
            for state in module.recipe_states(recipe) for tensor in state.state_tensors()]


def save(path: Path, fingerprint: str, step: int, model: nn.Module, optimizer: Any,
         generator: torch.Generator, recipe: Recipe | None, progress: dict[str, Any]) -> None:
    update_delayed_backward_scales()  # what the next autocast entry would do, done now
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "version": FORMAT_VERSION, "fingerprint": fingerprint, "step": step,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(), "rng": torch.get_rng_state(),
        "recipe_state": [t.detach().cpu().clone() for t in recipe_tensors(model, recipe)],
        **progress,
    }
    temporary = path.with_suffix(".tmp")
    torch.save(state, temporary)
    temporary.replace(path)  # a run stopped while saving keeps the previous checkpoint


def load(path: Path, fingerprint: str, label: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True)
    if state.get("version") != FORMAT_VERSION or state.get("fingerprint") != fingerprint:
        print(f"{label}: the checkpoint {path} was made under other settings; starting afresh",
              file=sys.stderr)
        return None
    return state


def restore(state: dict[str, Any], model: nn.Module, optimizer: Any,
            generator: torch.Generator, recipe: Recipe | None) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["rng"])
    with torch.no_grad():
        for tensor, saved in zip(recipe_tensors(model, recipe), state["recipe_state"],
                                 strict=True):
            tensor.copy_(saved)
