"""make_graphed_callables: CUDA-graph capture of quantized modules for eager users.

Why: an eager FP8 step is host-bound (every GEMM adds quantize launches and the Python that
drives them), and torch.compile is not every user's choice. TransformerEngine users take the
Python out of the step with `te.make_graphed_callables`; this is the same for minifloat, built on
`torch.cuda.make_graphed_callables`: the forward and backward of each callable are captured once
under the recipe, and every later call replays them, with no Python and no per-kernel launch
cost.

What the recipe adds to torch's capture:
- warm-up and capture run under `autocast(recipe)`, so the graphs hold the recipe's kernels;
- they leave no trace in the recipe state: delayed-scaling scales and amax histories are put
  back, in place, as they were before (the warm-up steps are not training steps);
- a replay must run inside `autocast` of the same recipe (a graph captured in FP8 cannot honour
  another recipe, nor run in high precision): anything else raises instead of silently running
  the captured format;
- delayed scaling: a replay records its amaxes where the captured kernels write them (the state
  tensors never move: updates are in place), and notes the callable's states in the round of
  the enclosing autocast, so their scales are updated at its exit as an eager call's are.

Module callables are found through their minifloat submodules (Linear, LayerNormLinear,
LayerNormMLP, GroupedLinear). Plain functions are allowed; the delayed-scaling states they use
are taken from what their capture noted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .autocast import (
    active_token,
    autocast,
    default_recipe,
    get_autocast_state,
    note_delayed_use,
    recipe_token,
    update_delayed_backward_scales,
)
from .modules.base import QuantizedModule
from .recipes import Recipe


def _quantized_modules(callable_: Callable) -> list[QuantizedModule]:
    if isinstance(callable_, nn.Module):
        return [m for m in callable_.modules() if isinstance(m, QuantizedModule)]
    return []


def _bind_and_snapshot(modules: list[QuantizedModule], token: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Create every module's recipe state before warm-up (so the graphs capture its tensors),
    and copy their values: (tensor, copy) pairs to put back after capture."""
    saved = []
    for module in modules:
        for tensor in module.binding(token).state:
            saved.append((tensor, tensor.clone()))
    return saved


def _guard(graphed: Callable, token: int, pairs: list, training: bool | None,
           module: nn.Module | None) -> Callable:
    """`graphed` behind the checks of a replay: the captured recipe is active, and the
    callable's delayed-scaling states are noted in the enclosing round."""

    @functools.wraps(graphed)
    def replay(*args, **kwargs):
        # torch's graphed module runs its eager forward when its training flag differs from the
        # capture's: that call quantizes (or not) by itself, like any eager call
        if module is None or module.training == training:
            if active_token() != token:
                raise RuntimeError(
                    "this callable was graphed by minifloat.make_graphed_callables under "
                    f"{'no recipe' if token == 0 else 'a recipe'} and replays only inside "
                    "minifloat.autocast with that same recipe (enabled=False if it was captured "
                    "with quantization off); call it inside that autocast, or graph it again")
            for pair in pairs:
                note_delayed_use(pair)
        return graphed(*args, **kwargs)

    return replay


def make_graphed_callables(
    callables: Callable | Sequence[Callable],
    sample_args: tuple | Sequence[tuple],
    *,
    recipe: Recipe | None = None,
    enabled: bool = True,
    amax_reduction_group: object = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: tuple | None = None,
) -> Callable | tuple[Callable, ...]:
    """CUDA-graphed versions of `callables` (modules or functions), captured under `recipe`.

    Arguments follow torch.cuda.make_graphed_callables (one callable with its tuple of sample
    arguments, or a tuple of callables with a tuple of argument tuples, in the order they run
    in forward), plus the recipe arguments of minifloat.autocast (TransformerEngine's
    fp8_enabled / fp8_recipe / fp8_group). Modules are returned with their forward replaced, as
    torch does. Call the results inside `minifloat.autocast(recipe=...)` with the same recipe.

    Torch's rules apply: static shapes, the sample arguments' dtypes and requires_grad, no
    module hooks, parameters updated in place (an optimizer step, not a new tensor). Keyword
    `is_first_microbatch` is not available inside a graph: a replay quantizes the weights it
    captured, each time.
    """
    if get_autocast_state().delayed_round is not None:
        raise RuntimeError(
            "make_graphed_callables was called inside minifloat.autocast; call it outside (it "
            "enters autocast itself for the capture, and an enclosing round would update "
            "delayed-scaling state from the warm-up steps)")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables captures CUDA graphs and needs a CUDA device; "
                           "on the CPU call the modules directly")
    single = not isinstance(callables, (tuple, list))
    group = (callables,) if single else tuple(callables)
    args = (sample_args,) if single else tuple(sample_args)
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a minifloat Recipe, got {type(recipe).__name__}")
    recipe = recipe if recipe is not None else default_recipe()
    token = recipe_token(recipe) if enabled else 0
    modules = [_quantized_modules(c) for c in group]
    for found in modules:
        for module in found:
            if module._state_device().type != "cuda":
                raise ValueError(f"{type(module).__name__} {module.name!r} has its parameters on "
                                 f"{module._state_device()}; move the model to CUDA before "
                                 "graphing it")
    # a step's pending backward-scale update belongs before the snapshot (the next autocast
    # entry would apply it anyway), so putting the snapshot back cannot undo it
    update_delayed_backward_scales()
    saved = [] if token == 0 else [
        pair for found in modules for pair in _bind_and_snapshot(found, token)]
    training = [c.training if isinstance(c, nn.Module) else None for c in group]
    with autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group):
        noted = get_autocast_state().delayed_round
        graphed = torch.cuda.make_graphed_callables(
            group, args, num_warmup_iters=num_warmup_iters,
            allow_unused_input=allow_unused_input, pool=pool)
        captured_pairs = list(noted.used.values()) if noted is not None else []
    # the warm-up and capture were not training steps: undo their delayed-scaling updates
    update_delayed_backward_scales()
    with torch.no_grad():
        for tensor, copy in saved:
            tensor.copy_(copy)
    results = []
    for callable_, found, was_training, result in zip(group, modules, training, graphed,
                                                      strict=True):
        if isinstance(callable_, nn.Module):
            pairs = [module._delayed_handles[recipe] for module in found
                     if recipe in module._delayed_handles] if token else []
            result.forward = _guard(result.forward, token, pairs, was_training, result)
        else:
            result = _guard(result, token, captured_pairs if token else [], None, None)
        results.append(result)
    return results[0] if single else tuple(results)
