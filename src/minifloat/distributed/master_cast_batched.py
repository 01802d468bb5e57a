"""quantize_master_weights on the GPU in a fixed number of launches (issue 16: "one launch per
step for all weights"): per-tensor current scaling here, and the block formats' plans.

Why: the reference cast (master_weights.py) runs per weight: an amax, a scale, a cast and two
copies, so a model of hundreds of weights pays hundreds of launches and their host time each
step. On the GPU the current-scaling weights are cast together here: one multi-tensor amax
launch over every rank's master range, one NaN-keeping MAX all-reduce of the stacked amaxes,
one multi-tensor cast launch (kernels/multi_tensor.py, whose bytes are the single-tensor
kernel's and so numerics'), then one foreach copy of the scales and one of the bytes into the
weights' ranges. The result equals the reference cast bit for bit
(tests/gpu/test_master_cast_batched_cuda.py).

Block FP8 (128x128), MXFP8 and 2D NVFP4 weights are grouped into plans (kernels/master_cast.py:
one maxima launch and one cast launch per format, master dtype and quantizer configuration);
master_weights reduces their maxima together with the reference casts' in its one all-reduce.
Delayed scaling, and any weight whose master or storage the kernels cannot serve, take the
reference path.
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


_PLAN_MASTER_DTYPES = (torch.float32, torch.bfloat16)


def block_batchable(cast) -> bool:
    """A block-format cast (block FP8 2D, MXFP8, 2D NVFP4) the plan kernels serve: on a kernel
    device, an fp32 or bf16 contiguous master (or none), and the rowwise bytes the reference
    writes (block FP8, NVFP4; the reference raises for NVFP4 without them)."""
    if cast.kind not in ("block", "mxfp8", "nvfp4"):
        return False
    storage = cast.storage
    data = storage.columnwise_data if cast.kind == "mxfp8" else None
    data = storage.rowwise_data if storage.rowwise_data is not None else data
    if data is None or not kernels.available(data):
        return False
    master = cast.master
    return master is None or (master.dtype in _PLAN_MASTER_DTYPES and master.is_contiguous()
                              and master.device == data.device)


def block_plans(casts: list, shapes: list) -> list[tuple[object, dict]]:
    """Plans (kernels/master_cast.PartialCastPlan) for block-format casts, all block_batchable,
    whose maxima offsets are assigned: one per format, master dtype and quantizer
    configuration; with the options of each plan's cast launch."""
    master_cast = kernel_module("master_cast")
    groups: dict[tuple, list] = {}
    for cast, shape in zip(casts, shapes, strict=True):
        storage = cast.storage
        if cast.kind == "block":
            options = {"power_2_scale": storage.quantizer.power_2_scale,
                       "amax_epsilon": storage.quantizer.amax_epsilon}
        elif cast.kind == "mxfp8":
            options = {"fp8_dtype": storage.fp8_dtype}
        else:
            options = {}
        dtype = cast.master.dtype if cast.master is not None else None
        groups.setdefault((cast.kind, dtype, tuple(sorted(options.items()))), []).append(
            (cast, shape, options))
    plans = []
    for (kind, _, _), members in groups.items():
        partials = [_partial(master_cast, cast, shape) for cast, shape, _ in members]
        device = next(p.row_data if p.row_data is not None else p.col_data for p in partials).device
        plans.append((master_cast.PartialCastPlan(kind, partials, device), members[0][2]))
    return plans


def _partial(master_cast, cast, shape: tuple[int, int]):
    """The kernel's view of one cast: its master range and the tensors it writes."""
    storage = cast.storage
    data = storage.rowwise_data if storage.rowwise_data is not None else storage.columnwise_data
    master = cast.master if cast.master is not None and cast.master.numel() else None
    common = {"master": master, "start": cast.start, "shape": shape,
              "maxima_offset": cast.offset, "base": cast.base,
              "rows_held": data.numel() * (2 if cast.kind == "nvfp4" else 1) // shape[1],
              "row_data": storage.rowwise_data}  # (NVFP4 packs two elements a byte)
    if cast.kind == "block":
        return master_cast.PartialCast(row_scale=storage.rowwise_scale_inv,
                                       col_scale=storage.columnwise_scale_inv, **common)
    if cast.kind == "mxfp8":
        return master_cast.PartialCast(row_scale=storage.rowwise_scale,
                                       col_data=storage.columnwise_data,
                                       col_scale=storage.columnwise_scale, **common)
    return master_cast.PartialCast(row_scale=storage.rowwise_scale,
                                   col_scale=storage.columnwise_scale,
                                   row_amax=storage.amax_rowwise,
                                   col_amax=storage.amax_columnwise
                                   if storage.columnwise_scale is not None else None, **common)


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
