"""make_graphed_step: a whole training step captured as one CUDA graph, FSDP2's included.

Why: a sharded FP8 step is host-bound. At the 1b preset on 2 x H200 under FSDP2 with FP8
all-gather, the eager step took 156 ms with 135 ms of host time; the GPU needs about 80
(BENCHMARKS.md, twenty-first session). make_graphed_callables cannot serve it: torch's refuses
modules with hooks (FSDP2's), and it leaves the collectives and the optimizer outside the
graphs. Capturing the whole step (forward, backward, FSDP2's all-gathers and reduce-scatters,
the optimizer step) takes the Python out: the same step replays in about 83 ms, 81 with each
block compiled. PyTorch's FSDP2 supports capture (pytorch/pytorch#171835 tests it); measured
on torch 2.11.

How: the first `num_warmup_iters` calls run eagerly on a side stream (FSDP2's lazy init, NCCL's
communicators, compilation, the kernels' first launches); they are real training steps. The
next call captures the step and replays it; every later call copies its tensors into the
captured inputs and replays. The capture runs in thread-local error mode: NCCL's watchdog
thread queries events while the step is captured.

Torch's rules for whole-network capture apply, and the step must follow them:
- every call passes tensors of the captured shapes, dtypes and devices (anything else raises),
  and the same non-tensor arguments;
- the optimizer is built with `capturable=True` (torch refuses to capture a step without it,
  `fused=True` included) and updates in place;
- Python in the step runs during warm-up and capture only: what the host decides (a learning
  rate held as a float, logging, a data-dependent branch) stays as captured;
- the outputs are the same tensors at every replay: clone what must outlive the next call.
A replay counts the optimizer steps the capture took (minifloat.optimizer_steps), so the
quantized-weight caches that eager calls read between replays (an evaluation forward under
FSDP2's FP8 all-gather, the eager weight-cast batch) see that the weights changed.
Delayed scaling is refused: its scale updates follow the Python of autocast's rounds
(make_graphed_callables handles them for per-module graphs). Current, block, MXFP8 and NVFP4
recipes keep no host state between steps; stochastic rounding draws its seeds from torch's
generator on the device, which capture advances at each replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from . import optimizer_steps
from .autocast import pending_delayed_round, update_delayed_backward_scales


def _layout(args: tuple, kwargs: dict) -> tuple[list[Any], Any, list[Any]]:
    """(leaves, structure, signature): tensors signed by shape, dtype and device, other leaves
    by their value."""
    leaves, structure = tree_flatten((args, kwargs))
    signature = [(tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor)
                 else leaf for leaf in leaves]
    return leaves, structure, signature


class GraphedStep:
    """A training step callable, captured on its (num_warmup_iters + 1)-th call (see the
    module docstring); call it as the step."""

    def __init__(self, step: Callable[..., Any], num_warmup_iters: int = 2) -> None:
        if num_warmup_iters < 1:
            raise ValueError(f"num_warmup_iters must be at least 1 (FSDP2, NCCL and the "
                             f"kernels initialise on the first call), got {num_warmup_iters}")
        self.step = step
        self.num_warmup_iters = num_warmup_iters
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: list[Any] = []
        self._structure: Any = None
        self._signature: list[Any] = []
        self._outputs: Any = None
        self._optimizer_steps = 0  # optimizer steps a replay takes (counted at capture)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, structure, signature = _layout(args, kwargs)
        if self.graph is None:
            _require_cuda(leaves)
            if self.calls < self.num_warmup_iters:
                self.calls += 1
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    outputs = self.step(*args, **kwargs)
                torch.cuda.current_stream().wait_stream(side)
                return outputs
            self._capture(args, kwargs, leaves, structure, signature)
        elif structure != self._structure or signature != self._signature:
            raise ValueError(
                f"a captured step replays the arguments it was captured with: got {signature}, "
                f"captured {self._signature}; make another make_graphed_step for this shape")
        for captured, leaf in zip(self._inputs, leaves, strict=True):
            if isinstance(captured, torch.Tensor):
                captured.copy_(leaf)
        self.graph.replay()
        optimizer_steps.add(self._optimizer_steps)
        return self._outputs

    def _capture(self, args: tuple, kwargs: dict, leaves: list[Any], structure: Any,
                 signature: list[Any]) -> None:
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static_args, static_kwargs = structure.unflatten(static)
        update_delayed_backward_scales()  # the last eager step's, before capture
        graph = torch.cuda.CUDAGraph()
        steps_before = optimizer_steps.count()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self.step(*static_args, **static_kwargs)
        except RuntimeError as error:
            raise RuntimeError(
                f"capturing the step as a CUDA graph failed: {error}. A captured step may not "
                "wait for the GPU on the host (.item(), .cpu(), printing a CUDA tensor, a "
                "non-capturable optimizer: build it with capturable=True); run those "
                "outside the step, on its returned tensors") from error
        self._optimizer_steps = optimizer_steps.count() - steps_before
        pending = pending_delayed_round()
        if pending is not None and pending.used:
            raise NotImplementedError(
                "make_graphed_step does not capture delayed scaling (its scale updates follow "
                "autocast's Python rounds); use a current-scaling, block, MXFP8 or NVFP4 "
                "recipe, or minifloat.make_graphed_callables for per-module graphs")
        self.graph, self._outputs = graph, outputs
        self._inputs, self._structure, self._signature = static, structure, signature


def _require_cuda(leaves: list[Any]) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_step captures CUDA graphs and needs a CUDA device; on "
                           "the CPU call the step directly")
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
            raise ValueError(f"make_graphed_step: an argument is on {leaf.device}; a captured "
                             "step reads its inputs from CUDA memory: move them to CUDA first")


def make_graphed_step(step: Callable[..., Any], *, num_warmup_iters: int = 2) -> GraphedStep:
    """`step` (forward, backward, optimizer step: a whole training iteration, under FSDP2 or
    not) as a callable that runs it eagerly `num_warmup_iters` times, then captures it as one
    CUDA graph and replays it at every later call. See the module docstring for the rules."""
    return GraphedStep(step, num_warmup_iters)
