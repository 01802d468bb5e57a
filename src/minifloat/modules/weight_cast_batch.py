"""Every FP8 weight of an eager forward pass cast at once: one or two launches a pass.

Why: an eager FP8 step is bound by host time. On the lean path (lean_fp8.py) each Linear
forward casts its weight alone: a launch and three allocations, 45-120 us of host time a weight
on the H100 hosts measured (benchmarks/gemm_host.py, host_profile.py), 80 weights a step at the
1b preset. Here the first forward of a forward pass casts every member weight at once, and each
Linear's forward takes its copies with a dictionary lookup (kernels/multi_tensor_each.py: each
copy its own allocation). Per-tensor current scaling takes a multi-tensor amax launch and a cast
launch; delayed scaling one launch, each weight cast with its recipe state's scale, its amax
folded into the state's slot, as its own cast would. Each weight's bytes are those of its own
cast (the GPU tests compare them). FSDP2's low-precision all-gather batches its shards the same
way (distributed/batched_weight_casts.py).

The rules:
- Members are plain weights (not quantized, not a subclass) that require grad, met by the lean
  path in a training forward (wgrad wanted, no FSDP2 rebuild) under per-tensor current or
  delayed scaling, registered on their module (module._parameters). A weight joins at its first
  such forward, which casts it alone; weak references, so a deleted model leaves.
- A batch casts the members used in the pass that last used the weight asking for its copies
  (the first of the pass): its model's weights, step after step, and not those of another
  model trained in turn. A member that pass did not use (a layer skipped) casts alone when
  used, and is batched from the pass after. Under delayed scaling a member that pass used and
  this one does not still folds its amax into its slot, which its next use's update reads (the
  same weight's amax).
- A batch casts only members that are their module's registered parameter at that moment, and
  leaves out for good a member that is not: FSDP2 registers a layer's unsharded parameter only
  from that layer's pre-forward on (its storage is freed, or being written by the all-gather,
  before), so FSDP2's layers cast alone; reading them early read freed memory (an illegal
  address on an H100, tests/gpu/test_distributed_nccl_single.py).
- A weight's copies hold while its stamp does: the optimizer steps taken in this process
  (optimizer_steps.py: fused and foreach steps bump no version counter), its version counter
  and its data pointer; under delayed scaling only within the pass that cast them (the scales
  are updated at each pass's end), and only for the cast (recipe state) that made them: after a
  switch to another delayed recipe, the first batch casts the members not yet seen under it
  with their old states (folding amaxes into those), and each of them casts alone.
- Copies are taken once: forward hands them to its GEMM and to backward and keeps none, so each
  lives as a single cast's would (the rowwise copy until its forward GEMM is done, the columnwise
  one until dgrad has read it; each copy is its own allocation, not a view into a shared
  buffer, which would keep them all alive until the last was dropped). They are only made
  earlier, at the pass's first forward, where memory is far from its peak.
- A batch runs at most once per forward pass (an outermost `autocast`, autocast.forward_pass),
  at the pass's first forward of a member: so every micro-batch that enters autocast gets one.
  A second use of a weight within one pass (a layer run twice, a weight tied to another) casts
  alone, and so does everything in backward (activation recompute: copies made there for every
  layer at once would stay alive through backward). Micro-batches run under one autocast get
  the batch at the first only.
- Copies not taken stay until a later pass takes them or a batch finds them stale: at most both
  copies of such members' weights, one byte a parameter each.

Eager only: the compiled ops (lean_ops.py) cast inside the graph, and so does a CUDA graph
capture (make_graphed_callables). MINIFLOAT_WEIGHT_CAST_BATCH=0 turns the batch off.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

import torch

from .. import kernels, optimizer_steps
from ..autocast import forward_pass
from ..quantizers.base import kernel_module

if TYPE_CHECKING:
    from .lean_fp8 import Cast

ENABLED = os.environ.get("MINIFLOAT_WEIGHT_CAST_BATCH", "1") != "0"

Copies = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (data [N, K], data_t [K, N], scale_inv)
Stamp = tuple[int, ...]


class EagerWeightCastBatch:
    """The member weights of one (device, dtype, kind of cast) and the copies last made for
    them (eager modules; FSDP2's shards batch in batched_weight_casts.WeightCastBatch)."""

    def __init__(self, cast: Cast) -> None:
        self.cast = cast
        self.delayed = cast.scale is not None
        # id(weight) -> (weight, its module, its name there), each weight and module weakly
        self.members: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
        self.left_out: dict[int, weakref.ref] = {}  # weights a batch found unregistered
        self.casts: dict[int, Cast] = {}  # the cast each member's forward last asked for
        self.used: dict[int, int] = {}  # the forward pass each member was last used in
        # (stamp, forward pass) when the member was last cast, by a batch or alone at joining
        self.batched: dict[int, tuple[Stamp, int]] = {}
        self.copies: dict[int, tuple[Stamp, Cast, Copies]] = {}
        self.batches = 0  # batches run (tests and benchmarks read it)
        optimizer_steps.watch()

    def _stamp(self, weight: torch.Tensor, current_pass: int) -> Stamp:
        """What the copies depend on: the optimizer steps taken in this process (fused and
        foreach steps bump no version counter), the version counter and the data pointer; under
        delayed scaling also the pass (the recipe state's scales change at each pass's end)."""
        stamp = (optimizer_steps.count(), weight._version, weight.data_ptr())
        return (*stamp, current_pass) if self.delayed else stamp

    def take(self, module: torch.nn.Module, weight: torch.Tensor, cast: Cast) -> Copies | None:
        """`weight`'s copies from the batch (cast now, with the members used in the pass that
        last used this weight, if they are not held), or None: the caller casts it alone (the
        weight's first sight, a second use in this pass, backward)."""
        key = id(weight)
        current_pass = forward_pass()
        stamp = self._stamp(weight, current_pass)
        held = self.copies.pop(key, None)
        if held is not None and held[0] == stamp and (not self.delayed or held[1] is cast):
            self.used[key] = current_pass
            return held[2]
        if torch._C._current_graph_task_id() != -1:
            return None  # in backward (activation recompute): copies made there would live on
        state = (stamp, current_pass)
        member = self.members.get(key)
        if member is None or member[0]() is not weight:
            left_out = self.left_out.get(key)
            if left_out is None or left_out() is not weight:
                self._join(key, weight, module, cast, state)
            return None
        self.casts[key] = cast
        last_use, self.used[key] = self.used.get(key), current_pass
        if self.batched.get(key) == state:
            return None  # cast in this pass already (a second use): cast alone
        self._cast_changed(current_pass, last_use)
        held = self.copies.pop(key, None)
        return held[2] if held is not None and held[0] == stamp else None

    def _join(self, key: int, weight: torch.Tensor, module: torch.nn.Module, cast: Cast,
              state: tuple[Stamp, int]) -> None:
        """Make `weight` a member, cast in this pass (the caller casts it alone)."""
        name = next((n for n, p in module._parameters.items() if p is weight), None)
        if name is None:
            return  # not a parameter of its module (a tied or computed weight): cast alone

        def leave(_: weakref.ref, key: int = key, batch: EagerWeightCastBatch = self) -> None:
            if batch.members.get(key, (None,))[0] is reference:
                del batch.members[key]
                for table in (batch.batched, batch.copies, batch.casts, batch.used):
                    table.pop(key, None)
            if batch.left_out.get(key) is reference:
                del batch.left_out[key]

        reference = weakref.ref(weight, leave)
        self.members[key] = (reference, weakref.ref(module), name)
        self.casts[key] = cast
        self.batched[key] = state
        self.used[key] = state[1]

    def _registered(self, key: int) -> torch.Tensor | None:
        """Member `key`'s weight if it is its module's registered parameter now, else None
        (and the member is left out for good when its weight lives on but is not)."""
        reference, module_reference, name = self.members[key]
        weight, module = reference(), module_reference()
        if weight is None or module is None:
            return None
        if module._parameters.get(name) is not weight:
            del self.members[key]
            for table in (self.batched, self.casts, self.used):
                table.pop(key, None)
            self.left_out[key] = reference
            return None
        return weight

    def _cast_changed(self, current_pass: int, last_use: int | None) -> None:
        """Drop every stale copy; cast every member used in `last_use` (the pass that last used
        the weight asking now: the members of its model) or in this pass, that this pass has not
        cast and whose copies are not held."""
        keys, weights, stamps = [], [], []
        wanted = (last_use, current_pass)
        for key in list(self.members):
            weight = self._registered(key)
            if weight is None:
                continue
            stamp = self._stamp(weight, current_pass)
            held = self.copies.get(key)
            if held is not None and held[0] != stamp:
                del self.copies[key]
                held = None
            if (held is None and self.used.get(key) in wanted
                    and self.batched.get(key) != (stamp, current_pass)):
                keys.append(key)
                weights.append(weight.detach())
                stamps.append(stamp)
        if len(weights) < 2:
            return  # nothing to batch (e.g. FSDP2's layers, each cast alone): cast alone
        casts = [self.casts[key] for key in keys]
        for key, stamp, cast, copies in zip(keys, stamps, casts, self._cast(weights, casts),
                                            strict=True):
            self.copies[key] = (stamp, cast, copies)
            self.batched[key] = (stamp, current_pass)
        self.batches += 1

    def _cast(self, weights: list[torch.Tensor], casts: list[Cast]) -> list[Copies]:
        if kernels.available(weights[0]):
            each = kernel_module("multi_tensor_each")
            if self.delayed:
                return each.quantize_delayed_scaling_each(
                    weights, self.cast.fp8_dtype, [cast.scale for cast in casts],
                    [cast.amax for cast in casts])
            return each.quantize_current_scaling_each(
                weights, self.cast.fp8_dtype, amax_epsilon=self.cast.amax_epsilon,
                power_2_scale=self.cast.power_2_scale)
        # no kernels (the CPU tests): each weight's own cast, the same bytes
        return [cast(w, rowwise=True, columnwise=True) for w, cast in zip(weights, casts,
                                                                            strict=True)]


_BATCHES: dict[tuple, EagerWeightCastBatch] = {}


def take(module: torch.nn.Module, weight: torch.Tensor, cast: Cast) -> Copies | None:
    """The batched copies of `module`'s parameter `weight` under per-tensor `cast` (current or
    delayed scaling; rules: module docstring), or None where it is cast alone."""
    if not ENABLED or type(weight) is not torch.nn.Parameter or not weight.is_contiguous():
        return None
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        # a CUDA graph capture (make_graphed_callables) casts alone, inside the graph: a batch
        # there would capture its table upload, and a copy made before the capture and taken
        # in it would be freed while the graph still reads it
        return None
    delayed = cast.scale is not None
    if delayed and not (cast.scale.device == cast.amax.device == weight.device):
        return None  # the recipe state lives elsewhere: the single cast's path handles it
    key = (weight.device, weight.dtype, cast.fp8_dtype, delayed, cast.amax_epsilon,
           cast.power_2_scale)
    batch = _BATCHES.get(key)
    if batch is None:
        batch = _BATCHES[key] = EagerWeightCastBatch(cast)
    return batch.take(module, weight, cast)


def batches_run() -> int:
    """Batches run in this process, over every group."""
    return sum(batch.batches for batch in _BATCHES.values())
