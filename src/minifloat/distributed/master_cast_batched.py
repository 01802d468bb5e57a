"""quantize_master_weights on the GPU in a fixed number of launches (issue 16: "one launch per
step for all weights, no per-tensor host work that grows beyond O(1) Python per tensor").

Why: the reference cast (master_weights.py) runs per weight in torch ops (maxima, scales, a
cast, copies into the ranges): a model of hundreds of weights paid thousands of launches and
their host time every step (1b over 8 ranks, one H100: 2161 launches and 30 ms for delayed
scaling, 5361 and 77 ms for block FP8, 14641 and 193 ms for MXFP8).

Here the casts the kernels serve are grouped into plans (kernels/master_cast_plan.py), one per
format, master dtype and quantizer configuration: each plan launches one maxima kernel (this
rank's maxima into master_weights' vector, which its all-reduce reduces together with any
reference cast's; MXFP8's E8M0 exponents into a uint8 one; delayed scaling casts in the same
pass), then current scaling's cast, delayed scaling's fold of the reduced amax, or the block
formats' scale kernel and their cast of the rank's window (kernels/master_cast.py). The bytes
are the reference's, bit for bit (tests/gpu/test_master_cast_kernels_cuda.py). A weight whose
master or storage the kernels cannot serve (on the CPU, an fp16 master, a non-contiguous one,
state on another device) takes the reference path.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..quantizers.base import kernel_module

_PLAN_MASTER_DTYPES = (torch.float32, torch.bfloat16)


def _bytes_of(cast) -> torch.Tensor | None:
    """The tensor of elements the cast writes by range (any one of them)."""
    storage = cast.storage
    if cast.kind in ("current", "delayed"):
        return storage.data
    if storage.rowwise_data is not None:
        return storage.rowwise_data
    return storage.columnwise_data if cast.kind == "mxfp8" else None


def plan_batchable(cast, kernel_devices: dict | None = None) -> bool:
    """A cast the plan kernels serve: on a kernel device, an fp32 or bf16 contiguous master (or
    none), the bytes the reference writes (the rowwise copy for block FP8 and NVFP4: the
    reference raises for NVFP4 without it), and delayed scaling's recipe state beside them.
    `kernel_devices` memoizes kernels.available per device over one call's casts."""
    data = _bytes_of(cast)
    if data is None:
        return False
    kernel_devices = {} if kernel_devices is None else kernel_devices
    served = kernel_devices.get(data.device)
    if served is None:
        served = kernel_devices[data.device] = kernels.available(data)
    if not served:
        return False
    master = cast.master
    if master is not None and not (master.dtype in _PLAN_MASTER_DTYPES
                                   and master.is_contiguous() and master.device == data.device):
        return False
    if cast.kind == "delayed":
        quantizer = cast.storage.quantizer
        return all(t.device == data.device and t.dtype == torch.float32 and t.numel() == 1
                   for t in (quantizer.scale, quantizer.amax))
    return True


def _options(cast) -> dict:
    """The cast launch's arguments that differ by quantizer configuration."""
    storage = cast.storage
    if cast.kind in ("current", "block"):
        quantizer = storage.quantizer
        options = {"power_2_scale": quantizer.power_2_scale,
                   "amax_epsilon": quantizer.amax_epsilon}
        if cast.kind == "current":
            options["fp8_dtype"] = quantizer.fp8_dtype
        return options
    if cast.kind == "delayed":
        return {"fp8_dtype": storage.quantizer.fp8_dtype}
    if cast.kind == "mxfp8":
        return {"fp8_dtype": storage.fp8_dtype}
    return {}


_PLANS: dict[tuple, object] = {}
_PLANS_KEPT = 8


def plans(casts: list, shapes: list) -> list:
    """Plans (kernels/master_cast_plan.PartialCastPlan) for casts that are all plan_batchable and
    whose maxima offsets are assigned: one per format, master dtype and quantizer
    configuration.

    A plan is kept across calls under the fingerprint of its casts (ranges, shapes, maxima
    offsets and the addresses of every tensor it reads or writes): a distributed optimizer
    casts the same ranges into the same buffers every step, and building the table was most
    of a call's host time (1b, 80 weights: ~2 ms on an H200 host). Any change of an address,
    range or layout gives a new fingerprint, hence a new plan; a kept plan holds its base
    tensors, so their addresses cannot be reused meanwhile."""
    master_cast_plan = kernel_module("master_cast_plan")
    groups: dict[tuple, list] = {}
    for cast, shape in zip(casts, shapes, strict=True):
        options = _options(cast)
        dtype = cast.master.dtype if cast.master is not None else None
        groups.setdefault((cast.kind, dtype, tuple(sorted(options.items(), key=str))),
                          []).append((cast, shape, options))
    built = []
    for group_key, members in groups.items():
        kind = group_key[0]
        key = (*group_key, *(_fingerprint(cast, shape) for cast, shape, _ in members))
        plan = _PLANS.get(key)
        if plan is None:
            partials = [_partial(master_cast_plan, cast, shape) for cast, shape, _ in members]
            device = _bytes_of(members[0][0]).device
            plan = master_cast_plan.PartialCastPlan(kind, partials, device, **members[0][2])
            if len(_PLANS) >= _PLANS_KEPT:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
        built.append(plan)
    return built


def _destinations(cast) -> dict:
    """The tensors the kernels write for one cast (and read: delayed scaling's state), by
    PartialCast field. Transposed copies that a format derives after the gather (per-tensor
    FP8, block FP8, 2D NVFP4) are not among them."""
    storage = cast.storage
    if cast.kind in ("current", "delayed"):
        delayed = cast.kind == "delayed"
        return {"row_data": storage.data, "row_scale": storage.scale_inv,
                "row_amax": storage.quantizer.amax if delayed else None,
                "scale_source": storage.quantizer.scale if delayed else None}
    if cast.kind == "block":
        return {"row_data": storage.rowwise_data, "row_scale": storage.rowwise_scale_inv}
    if cast.kind == "mxfp8":
        return {"row_data": storage.rowwise_data, "row_scale": storage.rowwise_scale,
                "col_data": storage.columnwise_data, "col_scale": storage.columnwise_scale}
    return {"row_data": storage.rowwise_data, "row_scale": storage.rowwise_scale,
            "row_amax": storage.amax_rowwise}


def _fingerprint(cast, shape: tuple[int, int]) -> tuple:
    """What a plan's table row is made of: the range, shape and maxima offset, and the address
    of the master and of every tensor the kernels write or read. Only those: the transposed
    copies that post_all_gather_processing rebuilds every step get new addresses, and had they
    counted, no plan would have been kept in a training loop."""
    master = cast.master
    addresses = tuple(0 if tensor is None else tensor.data_ptr()
                      for tensor in _destinations(cast).values())
    return (shape, cast.start, cast.offset, cast.base, addresses,
            (0, 0) if master is None else (master.data_ptr(), master.numel()))


def _partial(master_cast_plan, cast, shape: tuple[int, int]):
    """The kernel's view of one cast: its master range and the tensors it writes."""
    data = _bytes_of(cast)
    master = cast.master if cast.master is not None and cast.master.numel() else None
    # (NVFP4 packs two elements a byte)
    rows_held = data.numel() * (2 if cast.kind == "nvfp4" else 1) // shape[1]
    return master_cast_plan.PartialCast(
        master=master, start=cast.start, shape=shape, maxima_offset=cast.offset,
        base=cast.base, rows_held=rows_held, **_destinations(cast))
