"""Triton kernels for the quantizations of NUMERICS.md (the GPU fast path, DESIGN.md §4).

Every kernel is bit-exact against minifloat.numerics, the reference. This package imports on any
machine: Triton is imported lazily, only where a kernel is about to run, and `available(x)` says
whether the fast path can serve a tensor. On a CPU-only machine (no Triton installed) every
quantizer takes the numerics reference path.

`TRITON_INTERPRET=1` runs the kernels on CPU tensors through Triton's interpreter, for
development; note that the interpreter's own float8 casts do not round like the hardware's, so
kernels cast with explicit integer rounding where the interpreter must agree bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: torch.Tensor) -> bool:
    """Whether the Triton fast path can quantize `x` (a CUDA tensor, or any tensor under the
    interpreter), with Triton installed. MINIFLOAT_DISABLE_KERNELS=1 forces the reference."""
    if os.environ.get("MINIFLOAT_DISABLE_KERNELS", "0") == "1":
        return False
    if not triton_importable() or is_fake(x):
        return False
    return x.is_cuda or (interpreter_enabled() and x.device.type == "cpu")


def is_fake(x: torch.Tensor) -> bool:
    """Whether x is a fake tensor (torch.compile tracing, meta implementations): shapes only,
    so the quantizers take the pure-torch reference path, which lays out the same buffers."""
    return isinstance(x, FakeTensor)


def kernel_device() -> torch.device | None:
    """Where the kernels can run here: CUDA when present, the CPU under TRITON_INTERPRET=1, or
    None (no Triton, or neither). The kernel tests and benchmarks pick their device with it."""
    if not triton_importable():
        return None
    if torch.cuda.is_available():
        return torch.device("cuda")
    if interpreter_enabled():
        return torch.device("cpu")
    return None
