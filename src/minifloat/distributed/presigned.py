"""`presigned`: an FSDP2 extension hook whose signature inspect finds without parsing anything.

Why: FSDP2 (torch 2.11 to 2.13, FSDPParam.all_gather_inputs) calls
inspect.signature(tensor.fsdp_pre_all_gather) at every gather of every weight to learn how many
arguments the hook takes. On a plain function inspect parses the function anew each time: 17 ms
a step at the 1b preset (480 calls, cProfile on an H200 host). A `__signature__` stored on the
function is found, but through a bound method inspect still unwraps the method, reads the
function's signature and rebuilds it without `self` at every call (about 40 us each, 2.8 ms a
step for 32 weights on the CPU machine, .scratch profile of benchmarks/scale_step.py rows).

So the decorated method is a descriptor: on an instance it returns a small callable bound to
that instance that carries the bound signature, computed once per method; inspect.signature
returns it at its first check. On the class it returns the function itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class _BoundHook:
    """The hook bound to one tensor, with its bound signature (what inspect.signature returns)."""

    __slots__ = ("_method", "_instance", "__signature__")

    def __init__(self, method: Callable, instance: Any, signature: inspect.Signature) -> None:
        self._method = method
        self._instance = instance
        self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._method(self._instance, *args, **kwargs)


class presigned:  # noqa: N801 - used as a decorator, like property
    """Decorate a method that FSDP2 inspects at every call (see the module docstring)."""

    def __init__(self, method: Callable) -> None:
        self._method = method
        signature = inspect.signature(method)
        self._bound_signature = signature.replace(
            parameters=list(signature.parameters.values())[1:])
        self.__doc__ = method.__doc__
        self.__name__ = method.__name__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self._method
        return _BoundHook(self._method, instance, self._bound_signature)
