"""The FP8 current-scaling part of quantize_master_weights in a fixed number of launches
(issue 16: "one launch per step for all weights").

Why: the reference cast (master_weights.py) runs per weight: an amax, a scale, a cast and two
copies, so a model of hundreds of weights pays hundreds of launches and their host time each
step. On the GPU the current-scaling weights are cast together here: one multi-tensor amax
launch over every rank's master range, one NaN-keeping MAX all-reduce of the stacked amaxes,
one multi-tensor cast launch (kernels/multi_tensor.py, whose bytes are the single-tensor
kernel's and so numerics'), then one foreach copy of the scales and one of the bytes into the
weights' ranges. The result equals the reference cast bit for bit
(tests/gpu/test_master_cast_batched_cuda.py). Other formats, and any weight whose master the
kernels cannot read, take the reference path.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..quantizers.base import kernel_module


def batchable(cast) -> bool:
    """A current-scaling cast whose master (if any) the multi-tensor kernels read."""
    if cast.kind != "current" or cast.storage.data is None:
        return False
    reference = cast.master if cast.master is not None else cast.storage.scale_inv
    if not kernels.available(reference):
        return False
    return cast.master is None or kernel_module("per_tensor_fp8").kernel_input(cast.master)


def cast_current_scaling(casts: list, group) -> None:
    """Cast every master range of `casts` (all batchable) into its weight, grouped by master
    dtype and quantizer configuration: one amax launch, one all-reduce, one cast launch and two
    foreach copies per group."""
    from .master_weights import all_reduce_max_keep_nan

    groups: dict[tuple, list] = {}
    for cast in casts:
        quantizer = cast.storage.quantizer
        dtype = cast.master.dtype if cast.master is not None else torch.float32
        key = (dtype, cast.storage.scale_inv.device, quantizer.fp8_dtype,
               quantizer.amax_epsilon, quantizer.power_2_scale)
        groups.setdefault(key, []).append(cast)
    for (dtype, device, fp8_dtype, epsilon, pow2), members in groups.items():
        masters = [cast.master if cast.master is not None
                   else torch.empty(0, dtype=dtype, device=device) for cast in members]
        results = kernel_module("multi_tensor").quantize_current_scaling_multi(
            masters, fp8_dtype, amax_epsilon=epsilon, power_2_scale=pow2, rowwise=True,
            columnwise=False, reduce_amax=lambda amax: all_reduce_max_keep_nan(amax, group))
        scale_targets, scale_sources, byte_targets, byte_sources = [], [], [], []
        for cast, master, (data, _, scale_inv) in zip(members, masters, results, strict=True):
            scale_targets.append(cast.storage.scale_inv.view(-1))
            scale_sources.append(scale_inv.view(-1))
            if master.numel():
                start = cast.start - cast.base
                byte_targets.append(
                    cast.storage.data.view(torch.uint8).view(-1)[start:start + master.numel()])
                byte_sources.append(data.view(torch.uint8).view(-1))
        torch._foreach_copy_(scale_targets, scale_sources)
        if byte_targets:
            torch._foreach_copy_(byte_targets, byte_sources)
