"""Bytes moved by FSDP2's collectives, counted at the torch.distributed call (issue 18).

Why: the point of a low-precision all-gather is fewer bytes on the wire, and a profiler trace
does not say how many bytes a collective moved. FSDP2 calls `all_gather_single` /
`reduce_scatter_single` in recent torch releases and `all_gather_into_tensor` /
`reduce_scatter_tensor` in older ones (2.11); every name that exists is wrapped for the duration
of the `with` block, and a call made inside another counted call (one name implemented through
the other) is not counted twice. Counted per rank: all-gather input (what the rank sends) and
output (what it receives) bytes, reduce-scatter input bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def _tensor(args: tuple, kwargs: dict, index: int, names: tuple[str, ...]) -> torch.Tensor:
    if len(args) > index:
        return args[index]
    return next(kwargs[name] for name in names if name in kwargs)


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[dict[str, int]]:
    """with count_collective_bytes() as moved: ... -> moved["all_gather_input_bytes"],
    moved["all_gather_output_bytes"], moved["reduce_scatter_input_bytes"] (this rank's)."""
    moved = {"all_gather_input_bytes": 0, "all_gather_output_bytes": 0,
             "reduce_scatter_input_bytes": 0}
    depth = [0]
    originals: dict[str, Callable] = {}

    def counting(name: str, function: Callable) -> Callable:
        def call(*args, **kwargs):
            if depth[0] == 0:
                output = _tensor(args, kwargs, 0, ("output_tensor", "output"))
                given = _tensor(args, kwargs, 1, ("input_tensor", "input"))
                if name in _GATHERS:
                    moved["all_gather_input_bytes"] += given.numel() * given.element_size()
                    moved["all_gather_output_bytes"] += output.numel() * output.element_size()
                else:
                    moved["reduce_scatter_input_bytes"] += given.numel() * given.element_size()
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name in (*_GATHERS, *_SCATTERS):
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, counting(name, originals[name]))
    try:
        yield moved
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
