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
_COMPILED: dict[tuple, tuple[Any, int]] = {}
_INT32 = range(-(2**31), 2**31)


def _argument_key(value: Any) -> tuple:
    """What Triton specialises a runtime argument on (conservatively: a superset)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, value in _INT32, value >= 0)
    if isinstance(value, float):
        return ("float",)
    return ("value", value)


def _direct_allowed(kernel: Any, args: tuple) -> bool:
    if not _DIRECT or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return False
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return all(_no_hook(hook) for hook in hooks)


def _no_hook(hook: Any) -> bool:
    """Whether a launch hook slot is empty: None in older Tritons; from Triton 3.6 on a HookChain
    object that is never None and holds its hooks in `.calls` (an `is None` test alone turned
    the direct path off for every launch there, silently: found by benchmarks/host_profile.py)."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int = 4,
           options: dict[str, Any] | None = None, **constexprs: Any) -> None:
    """kernel[grid](*args, num_warps=..., **options, **constexprs), with the direct path.

    `args` are the kernel's runtime arguments in order; `constexprs` its constexpr parameters
    by name (they must be the parameters after `args`); `options` compile options such as
    enable_fp_fusion.
    """
    global _DIRECT
    options = options or {}
    if not _direct_allowed(kernel, args):
        kernel[grid](*args, num_warps=num_warps, **options, **constexprs)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, tuple(sorted(options.items())),
           tuple(constexprs.items()), tuple(_argument_key(a) for a in args))
    entry = _COMPILED.get(key)
    if entry is not None:
        compiled, _ = entry
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        trailing = tuple(constexprs[name] for name in kernel.arg_names[len(args):])
        try:
            compiled.run(grid3[0], grid3[1], grid3[2], torch._C._cuda_getCurrentRawStream(device),
                         compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *trailing)
            return
        except (TypeError, AttributeError):  # another Triton's launcher: use Triton's path
            _DIRECT = False
            _COMPILED.clear()
    compiled = kernel[grid](*args, num_warps=num_warps, **options, **constexprs)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    if set(kernel.arg_names[len(args):]) == set(constexprs):
        _COMPILED[key] = (compiled, len(args))
