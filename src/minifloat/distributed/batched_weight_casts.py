"""Every FP8 current-scaling weight shard of a model quantized at once, for FSDP2's all-gathers.

Why: FSDP2 calls `fsdp_pre_all_gather` once per weight and gather (forward, and again for
backward's re-gather). Quantizing there costs per weight a quantizer copy, an amax pass, an
amax all-reduce over the shard group, a cast launch and storage objects: at the 1b preset on
one H200 the FP8 all-gather step spent 60 ms more host time than the bf16 one
(BENCHMARKS.md, 2026-11-26). Here the first gather after the weights changed quantizes every
current-scaling shard of the model in one multi-tensor amax launch, one all-reduce of the
stacked amaxes and one cast launch (kernels/multi_tensor.py; the reference functions off the
GPU), and each later gather of an unchanged weight (the rest of forward, backward's re-gather,
further micro-batches) hands over the bytes already made.

The bytes are those of quantizing each shard alone with its amax reduced over the group: the
same amaxes, the same MAX reduction, the same cast (the multi-tensor kernels write the
single-tensor bytes). A shard is stale after any optimizer step (a global step post-hook
counts them: foreach and fused steps, CUDA's defaults, bump no version counter) and when the
version counter of its parameter moved (load_state_dict and every other in-place op on the
parameter bump it). A change through `.data`, or by a foreach op outside an optimizer step, is
not seen (minifloat/optimizer_steps.py): change sharded weights in place through the parameter
itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels, numerics, optimizer_steps
from ..quantizers import Float8CurrentScalingQuantizer, Quantizer
from ..quantizers.base import kernel_module


def batchable(quantizer: Quantizer) -> bool:
    """Weights whose gather inputs depend on nothing but the shard and the reduced amax."""
    return type(quantizer) is Float8CurrentScalingQuantizer


class WeightCastBatch:
    """The current-scaling weights of one model (module, parameter name) and the gather
    inputs last made for each: (the shard's version when made, the mesh, the inputs).

    The modules are held by weak reference: every wrapped shard holds the batch, and a strong
    path back from the batch to the modules (and so to the shards) would make a cycle through
    tensors that Python's collector does not traverse (a tensor that C++ also holds, such as
    a parameter, hides its attributes from it), and the whole model would outlive its last
    user's reference."""

    def __init__(self) -> None:
        self.members: list[tuple[weakref.ref[nn.Module], str, Quantizer]] = []
        self.made: dict[int, tuple[tuple[int, int], Any, tuple]] = {}
        optimizer_steps.watch()

    def add(self, module: nn.Module, name: str, quantizer: Quantizer) -> int:
        output = quantizer.copy()  # what the gathered storage records, as a quantize call's
        output.set_usage(rowwise=True, columnwise=False)
        output.internal = True
        self.members.append((weakref.ref(module), name, output))
        return len(self.members) - 1

    def _version(self, index: int) -> tuple[int, int]:
        """What changes when member `index`'s weight may have: the optimizer steps taken, and
        the version counter of its parameter (the FSDP2 DTensor; in-place ops on it bump it,
        the wrappers inside see none: tensor subclasses run below autograd)."""
        module, name, _ = self.members[index]
        return optimizer_steps.count(), getattr(module(), name)._version

    def gather_inputs(self, index: int, mesh) -> tuple | None:
        """The (all-gather inputs, metadata) of member `index`, made with the whole batch when
        its parameter changed; None when this weight cannot be batched (then it is quantized
        alone)."""
        made = self.made.get(index)
        version = self._version(index)
        if made is None or made[0] != version or (made[1] is not mesh and made[1] != mesh):
            self._make_all(mesh)
            made = self.made.get(index)
        if made is None or made[0] != version:
            return None
        return made[2]

    def _make_all(self, mesh) -> None:
        from .fsdp import LowPrecisionGatherWeight

        groups: dict[tuple, list[tuple[int, torch.Tensor, Quantizer]]] = {}
        for index, (module, name, quantizer) in enumerate(self.members):
            parameter = getattr(module(), name, None)
            local = getattr(parameter, "_local_tensor", parameter)
            if (not isinstance(local, LowPrecisionGatherWeight)
                    or getattr(parameter, "device_mesh", None) != mesh):
                continue  # not sharded over this mesh (yet): gathered alone
            shard = local._inner
            key = (shard.dtype, shard.device, quantizer.fp8_dtype, quantizer.amax_epsilon,
                   quantizer.power_2_scale)
            version = (optimizer_steps.count(), parameter._version)  # what _version(index) reads
            groups.setdefault(key, []).append((index, shard, quantizer, version))
        reduce = _all_reduce_max(mesh)
        for members in groups.values():
            shards = [shard.detach() for _, shard, _, _ in members]
            for (index, _, quantizer, version), (data, scale_inv) in zip(
                    members, _quantize(shards, members[0][2], reduce), strict=True):
                inputs = ((data.view(torch.uint8),),
                          ("fp8", quantizer, quantizer.fp8_dtype, scale_inv))
                self.made[index] = (version, mesh, inputs)


def _all_reduce_max(mesh) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """MAX over the shard group, as the quantizer's reduce_amax does per weight (none at one
    rank, where the shard's amax is the weight's)."""
    if mesh.size() == 1:
        return None
    group = mesh.get_group()

    def reduce(amaxes: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        return amaxes

    return reduce


def _quantize(shards: list[torch.Tensor], quantizer: Float8CurrentScalingQuantizer,
              reduce: Callable[[torch.Tensor], torch.Tensor] | None
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(rowwise data [rows, K], scale_inv) of every shard: one amax pass, one reduction, one
    cast pass (kernels), or the reference functions one shard at a time around one reduction."""
    fp8_dtype, epsilon, pow2 = (quantizer.fp8_dtype, quantizer.amax_epsilon,
                                quantizer.power_2_scale)
    if kernels.available(shards[0]) and all(kernel_module("per_tensor_fp8").kernel_input(s)
                                    for s in shards):
        results = kernel_module("multi_tensor").quantize_current_scaling_multi(
            shards, fp8_dtype, amax_epsilon=epsilon, power_2_scale=pow2, rowwise=True,
            columnwise=False, reduce_amax=reduce)
        return [(data, scale_inv) for data, _, scale_inv in results]
    amaxes = torch.stack([numerics.compute_amax(s).reshape(()) for s in shards]).float()
    if reduce is not None:
        amaxes = reduce(amaxes)
    out = []
    for index, shard in enumerate(shards):
        data, scale_inv = numerics.quantize_current_scaling(
            shard, fp8_dtype, amax=amaxes[index], amax_epsilon=epsilon, power_2_scale=pow2)
        out.append((data.reshape(shard.shape), scale_inv.reshape(1)))  # a storage's shape
    return out
