"""minifloat's torch ops defined through torch.library.Library, not torch.library.custom_op.

Why: custom_op calls each implementation through a Python wrapper
(torch._library.custom_ops.backend_impl) that checks its outputs' aliasing on every call. On the
H200 hosts measured (BENCHMARKS.md, seventh session) cProfile gave that wrapper 0.6 ms of self
time per call of the GEMM ops, more than the lean path's own Python, in every compiled step
that runs without CUDA graphs (FSDP2's). A Library op calls the implementation directly. The
schema is inferred from the function's annotations as custom_op infers it
(torch.library.infer_schema), torch.library.register_fake and register_autograd take these ops
as they take custom ops, and the aliasing rule holds by construction (gemm_op._unaliased).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("minifloat", "FRAGMENT")


def define_op(name: str, implementation: Callable, fake: Callable | None = None
              ) -> torch._ops.OpOverload:
    """torch.ops.minifloat.<name>.default, running `implementation` on every device, and
    `fake` (default: the implementation itself) on fake tensors."""
    _LIBRARY.define(name + torch.library.infer_schema(implementation, mutates_args=()))
    _LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"minifloat::{name}", fake or implementation, lib=_LIBRARY)
    return getattr(torch.ops.minifloat, name).default
