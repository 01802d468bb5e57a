"""Kernel launches with less host time: the compiled kernel, cached per specialization.

A Linear step under current scaling launches six quantization kernels, and at (16384, 4096,
4096) on an H100 the step is bound by host time, not by the GPU (benchmarks/profile_step.py).
`kernel[grid](...)` spends tens of microseconds a launch in Triton's Python before the driver
call: binding and specialising every argument, hashing the cache key, checking globals, hooks.
`launch` keeps the CompiledKernel the first launch returned, keyed by everything Triton
specialises on (each tensor's dtype and 16-byte alignment, each integer's value class: equal
to 1, divisible by 16, its integer width; the constexprs, warps and options; the device), and
later launches call its launcher directly.

The first launch of every key goes through Triton as usual (it compiles), and so does every
launch under the interpreter, with a launch hook set (profilers), on a kernel whose keyword
arguments are not exactly its trailing constexprs, or when MINIFLOAT_TRITON_LAUNCH=1 asks for
Triton's own path. If the direct call ever fails with a TypeError or AttributeError (another
Triton's launcher signature), the direct path turns itself off for the process.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_DIRECT = os.environ.get("MINIFLOAT_TRITON_LAUNCH", "0") != "1"
# Triton picks the interpreter when a kernel is defined (at import), so reading the variable
# once is what Triton itself honours; an environment read per launch cost host time
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# key -> (compiled kernel, its trailing constexpr values in signature order)
_COMPILED: dict[tuple, tuple[Any, tuple]] = {}
_INT32 = range(-(2**31), 2**31)
# plan key -> (compiled kernel, trailing constexpr values): launch_planned's cache
_PLANNED: dict[tuple, tuple[Any, tuple]] = {}
_KNOBS: list[Any] = []  # triton.knobs, imported once (an import statement a launch cost
#                          about a microsecond of host time)


def _argument_key(value: Any) -> tuple:
    """What Triton specialises a runtime argument on (conservatively: a superset)."""
    kind = type(value)  # exact scalar types first (most arguments), then the isinstance chain
    if kind is int:
        return ("int", value == 1, value % 16 == 0, value in _INT32, value >= 0)
    if kind is bool:
        return ("bool", value)
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, value in _INT32, value >= 0)
    if isinstance(value, float):
        return ("float",)
    return ("value", value)


def _launch_hooks() -> tuple[Any, Any]:
    if not _KNOBS:
        from triton import knobs

        _KNOBS.append(knobs)
    runtime = _KNOBS[0].runtime
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def _direct_allowed(kernel: Any, args: tuple) -> bool:
    if not _DIRECT or _INTERPRET:
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            break
    else:
        return False
    enter, leave = _launch_hooks()
    return _no_hook(enter) and _no_hook(leave)


def _no_hook(hook: Any) -> bool:
    """Whether a launch hook slot is empty: None in older Tritons; from Triton 3.6 on a HookChain
    object that is never None and holds its hooks in `.calls` (an `is None` test alone turned
    the direct path off for every launch there, silently: found by benchmarks/host_profile.py)."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int = 4,
           options: dict[str, Any] | None = None, **constexprs: Any) -> tuple | None:
    """kernel[grid](*args, num_warps=..., **options, **constexprs), with the direct path.

    `args` are the kernel's runtime arguments in order; `constexprs` its constexpr parameters
    by name (they must be the parameters after `args`); `options` compile options such as
    enable_fp_fusion. Returns the (compiled kernel, trailing constexprs) entry the direct path
    keeps for this key, or None where there is none.
    """
    global _DIRECT
    options = options or {}
    if not _direct_allowed(kernel, args):
        kernel[grid](*args, num_warps=num_warps, **options, **constexprs)
        return None
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, tuple(sorted(options.items())) if options else (),
           tuple(constexprs.items()), tuple([_argument_key(a) for a in args]))
    entry = _COMPILED.get(key)
    if entry is not None:
        compiled, trailing = entry
        # the key holds every constexpr value, so the trailing values are those of the first
        # launch under this key (kept with the compiled kernel instead of rebuilt per launch)
        grid_x = grid[0]
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        try:
            compiled.run(grid_x, grid_y, grid_z, torch._C._cuda_getCurrentRawStream(device),
                         compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *trailing)
            return entry
        except (TypeError, AttributeError):  # another Triton's launcher: use Triton's path
            _DIRECT = False
            _COMPILED.clear()
    compiled = kernel[grid](*args, num_warps=num_warps, **options, **constexprs)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    names = kernel.arg_names[len(args):]
    if set(names) == set(constexprs):
        entry = _COMPILED[key] = (compiled, tuple(constexprs[name] for name in names))
        return entry
    return None


def launch_planned(plan_key: tuple, device_index: int, kernel: Any, grid: tuple[int, ...],
                   *args: Any, num_warps: int = 4, **constexprs: Any) -> None:
    """launch(), keyed by the caller's `plan_key` instead of a key built from every argument.

    For the hottest launches (the one-launch current-scaling cast runs twice per Linear
    forward): building launch's key costs a few microseconds an argument. `plan_key` must
    determine everything launch's key holds: the kernel, the dtypes and 16-byte alignment of
    the tensor arguments, the value classes of the integer arguments and the constexprs; the
    arguments must be CUDA tensors on device `device_index`.
    """
    entry = _PLANNED.get(plan_key)
    if entry is not None and _DIRECT:
        enter, leave = _launch_hooks()
        if _no_hook(enter) and _no_hook(leave):
            compiled, trailing = entry
            try:
                compiled.run(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(device_index),
                             compiled.function, compiled.packed_metadata, None, None, None,
                             *args, *trailing)
                return
            except (TypeError, AttributeError):
                _PLANNED.clear()
    entry = launch(kernel, grid, *args, num_warps=num_warps, **constexprs)
    if entry is not None:
        _PLANNED[plan_key] = entry
