"""ZeRO / distributed-optimizer master-weight casts (seed 004): each rank owns a flat element
range of every weight's fp32 master copy and writes that range of the low-precision model
weight; the distributed optimizer then all-gathers the bytes.

The names follow the seed: `quantize_master_weights(model_weights, master_weights,
start_offsets, group, ...)` and `post_all_gather_processing(model_weights)`.

Why a partial cast gives the bytes of the full cast: every scale depends on an absolute maximum
(of the tensor, a 128x128 tile or a 32-element block), and a maximum of maxima is the maximum.
Each rank computes the maxima of what it holds (the elements outside its range count as zeros,
which cannot raise an absolute maximum), one MAX all-reduce over `group` combines them for all
weights at once, and then every rank derives the same scales and casts its own elements, which
each depend only on their own value and their scale. NaN is carried through the all-reduce as a
separate flag (a MAX all-reduce need not propagate NaN), so a NaN anywhere still gives the
scales a NaN gives the full cast. MXFP8 reduces its blocks' E8M0 exponents (uint8) instead of
their maxima: the exponent rule is monotone, so the exponent of the largest maximum is the
largest exponent; a quarter of the bytes, and a NaN's exponent (255) is the largest of all.

Formats: per-tensor FP8 with current scaling (the scale from the reduced amax) and with delayed
scaling (the scale of the recipe state; the reduced amax is recorded into its history slot),
128x128 block FP8 and MXFP8 (both copies written, their layouts being [M, K] each). The
columnwise copies of per-tensor and block FP8 are transposes of the rowwise bytes and scales,
made after the all-gather by `post_all_gather_processing` (the cast leaves them, scales
included, stale). 2D NVFP4 (weights): the global amax and the 16x16 tile maxima are reduced,
the rank writes its elements nibble by nibble (a range may start or end inside a byte), and
the columnwise copy is the nibble transpose of the gathered bytes. A byte shared by two ranks
holds each rank's nibble only on that rank: gather such bytes by OR-ing the ranks' nibbles
(each rank's other nibble is left as it was).

Hybrid weights (HybridRecipe: one format per direction) cast each sub-storage in its own
format; a columnwise sub-storage of a format that derives its transposed copy keeps a rowwise
copy for the ranges and the gather (cast_targets).

This is the reference implementation (pure torch, any device); on the GPU every format runs in
two launches per format instead (master_cast_batched.py, kernels/master_cast.py). A block
format quantizes the whole tile rows its range touches (fp32, zeros outside the range): tiles
are independent, so those rows give the range's bytes, and every scale comes from the reduced
maxima without the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import numerics
from ..numerics.blocks import as_2d, tile_amax
from ..numerics.nvfp4 import scale_2d as nvfp4_scale_2d
from ..quantizers import (
    Float8BlockStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Storage,
    HybridStorage,
    MXFP8Storage,
    NVFP4Storage,
    QuantizedTensor,
)
from .master_cast_batched import plan_batchable
from .master_cast_batched import plans as batched_plans
from .quantized_shards import local_shard

_MX_BLOCK = 32
_TILE = 128
_FP4_TILE = 16


@dataclass
class _Cast:
    """One weight's share of the step: its storage, this rank's master range, and the slice of
    the reduced amax vector that holds its maxima."""

    storage: object
    master: torch.Tensor | None
    start: int
    kind: str  # "current", "delayed", "block", "mxfp8", "nvfp4"
    offset: int = 0  # into the amax vector
    count: int = 0
    # block formats: the tile rows this rank's range touches (fp32, zeros outside the range)
    # and the first of them, built once per call
    window: torch.Tensor | None = None
    window_row: int = 0
    base: int = 0  # the element of the full weight where `storage` starts (an FSDP2 shard's)


def _device(cast: _Cast) -> torch.device:
    """Where this weight lives (its maxima go there: the all-reduce runs on that device)."""
    if cast.master is not None:
        return cast.master.device
    storage = cast.storage
    return next(getattr(storage, name) for name in storage.tensor_fields()
                if getattr(storage, name) is not None).device


def _check(model_weight, master, start, index) -> tuple[object, int]:
    """(the storage to cast into, the element of the full weight where it starts)."""
    shard = local_shard(model_weight)
    if shard is not None:  # an FSDP2 shard of FP8 bytes: the rank writes its own rows
        local, first_row = shard
        offset = first_row * local.shape[1]
        if master is not None and not (
                offset <= start <= start + master.numel() <= offset + local.numel()):
            raise ValueError(
                f"master_weights[{index}] covers elements [{start}, {start + master.numel()}) "
                f"of the weight, but this rank's FSDP2 shard holds [{offset}, "
                f"{offset + local.numel()}); give each rank the master of its own shard")
        return local.shard_storage(), offset
    if not isinstance(model_weight, QuantizedTensor):
        raise TypeError(
            f"model_weights[{index}] is a {type(model_weight).__name__}; quantize_master_weights "
            "casts into QuantizedTensor weights (build the model under mf.quantized_model_init)")
    storage = model_weight.quantized_storage
    if master is None:
        return storage, 0
    if master.dim() != 1 or not master.is_floating_point():
        raise ValueError(
            f"master_weights[{index}] must be a flat (1-D) floating-point shard, got shape "
            f"{tuple(master.shape)} and dtype {master.dtype}; pass master.view(-1)")
    numel = model_weight.numel()
    if not 0 <= start <= start + master.numel() <= numel:
        raise ValueError(
            f"master_weights[{index}] covers elements [{start}, {start + master.numel()}) of a "
            f"weight of {numel} elements; start_offsets[{index}] or the shard length is wrong")
    return storage, 0


def _kind(storage) -> str:
    if isinstance(storage, Float8Storage):
        quantizer = storage.quantizer
        if isinstance(quantizer, Float8Quantizer):
            return "delayed"
        if isinstance(quantizer, Float8CurrentScalingQuantizer):
            return "current"
    if isinstance(storage, Float8BlockStorage) and storage.block_scaling_dim == 2:
        return "block"
    if isinstance(storage, MXFP8Storage):
        return "mxfp8"
    if isinstance(storage, NVFP4Storage) and storage.two_dimensional:
        quantizer = storage.quantizer
        if getattr(quantizer, "stochastic_rounding", False):
            raise ValueError(
                "quantize_master_weights: the NVFP4 weight quantizer uses stochastic rounding, so "
                "no partial cast can equal the full one; weights take round-to-nearest "
                "(NVFP4BlockScaling applies stochastic rounding to gradients only)")
        return "nvfp4"
    raise NotImplementedError(
        f"quantize_master_weights does not cast into {storage.format_name} weights "
        f"({type(storage).__name__}{'' if storage.format_name != 'NVFP4' else ', 1D'}); "
        "per-tensor FP8 (current or delayed), 128x128 block FP8, MXFP8 and 2D (16x16) NVFP4 "
        "are supported")


# rows of one scale tile (or MXFP8's columnwise block) along the weight's rows, per format
_TILE_ROWS = {"block": _TILE, "nvfp4": _FP4_TILE, "mxfp8": _MX_BLOCK}


def _window(cast: _Cast, shape: tuple[int, int]) -> torch.Tensor:
    """The whole tile rows that this rank's range touches, in fp32, the range filled in and
    zeros elsewhere (a zero never raises a maximum), starting at row cast.window_row; built
    once per weight and call (the maxima and the cast both read it). Why not the full weight:
    every rank would hold the whole model in fp32 during the cast; tiles are independent, so
    the rows of the tiles the range touches decide its bytes."""
    if cast.window is None:
        rows, columns = shape
        tile = _TILE_ROWS[cast.kind]
        count = 0 if cast.master is None else cast.master.numel()
        if count == 0:
            cast.window_row, cast.window = 0, torch.zeros(0, columns, device=_device(cast))
            return cast.window
        first = cast.start // columns // tile * tile
        last = min(-(-(cast.start + count) // columns // tile) * tile, rows)
        window = torch.zeros((last - first) * columns, dtype=torch.float32,
                             device=_device(cast))
        offset = cast.start - first * columns
        window[offset:offset + count] = cast.master.float()
        cast.window_row, cast.window = first, window.view(last - first, columns)
    return cast.window


def _placed(local: torch.Tensor, first: int, total: int) -> torch.Tensor:
    """A grid of `total` rows, zeros but for `local` from row `first` on."""
    grid = torch.zeros(total, local.shape[1], dtype=torch.float32, device=local.device)
    grid[first:first + local.shape[0]] = local
    return grid


def _partial_maxima(cast: _Cast, shape: tuple[int, int]) -> torch.Tensor:
    """The flat vector of maxima this rank contributes for one weight (zeros if it holds none
    of it: a zero never raises a maximum)."""
    if cast.kind in ("current", "delayed"):
        if cast.master is None or cast.master.numel() == 0:
            return torch.zeros(1, device=_device(cast))
        return numerics.compute_amax(cast.master).reshape(1)
    window, first, rows = _window(cast, shape), cast.window_row, shape[0]
    if cast.kind == "block":
        return _placed(tile_amax(window, _TILE, _TILE), first // _TILE,
                       -(-rows // _TILE)).reshape(-1)
    if cast.kind == "nvfp4":  # the global amax, then the 16x16 tile maxima
        return torch.cat([numerics.compute_amax(window).reshape(1),
                          _placed(tile_amax(window, _FP4_TILE, _FP4_TILE), first // _FP4_TILE,
                                  rows // _FP4_TILE).reshape(-1)])
    # MXFP8: the blocks' E8M0 exponents (uint8), not their maxima: the exponent rule is
    # monotone, so the exponent of the reduced maximum is the maximum of the exponents, and the
    # ranks reduce a quarter of the bytes (exponent 0 is a zero block's: it raises no maximum)
    element_max = numerics.fp8_format(cast.storage.fp8_dtype).max_value
    return numerics.e8m0_exponent(torch.cat([
        _placed(tile_amax(window, 1, _MX_BLOCK), first, rows).reshape(-1),
        _placed(tile_amax(window, _MX_BLOCK, 1), first // _MX_BLOCK,
                rows // _MX_BLOCK).reshape(-1)]), element_max)


def all_reduce_max_keep_nan(values: torch.Tensor, group, in_place: bool = False
                            ) -> torch.Tensor:
    """MAX over the group, NaN-preserving: NaN travels as a flag beside the values (integer
    values, such as E8M0 exponents whose NaN is 255, the largest, reduce as they are).
    in_place: integer values are reduced in `values` itself, which is returned (a caller that
    owns a scratch vector saves its copy: the 1b preset's MXFP8 exponents are 63 MB)."""
    if group is None:
        return values
    if not values.is_floating_point():
        reduced = values if in_place else values.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        return reduced

    nan = torch.isnan(values)
    packed = torch.cat([torch.where(nan, torch.zeros_like(values), values), nan.float()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    reduced, flags = packed.split(values.numel())
    return torch.where(flags > 0, torch.full_like(reduced, float("nan")), reduced)


def _write_range(buffer: torch.Tensor, values: torch.Tensor, start: int) -> None:
    buffer.view(-1)[start:start + values.numel()] = values.reshape(-1).to(buffer.device)


def _cast(cast: _Cast, maxima: torch.Tensor, shape: tuple[int, int]) -> None:
    storage, quantizer = cast.storage, cast.storage.quantizer
    if cast.kind in ("current", "delayed"):
        device = storage.scale_inv.device
        amax = maxima.reshape(()).to(device)
        if cast.kind == "current":
            scale = numerics.scale_from_amax(
                amax, numerics.fp8_format(quantizer.fp8_dtype).max_value,
                amax_epsilon=quantizer.amax_epsilon, power_2_scale=quantizer.power_2_scale)
        else:
            quantizer.amax.copy_(torch.maximum(quantizer.amax,
                                               amax.reshape(quantizer.amax.shape)))
            scale = quantizer.scale.reshape(()).to(device)
        storage.scale_inv.copy_(torch.reciprocal(scale.float()).reshape(storage.scale_inv.shape))
        if cast.master is not None and storage.data is not None:
            data, _ = numerics.quantize_with_scale(cast.master.to(device), scale,
                                                   quantizer.fp8_dtype)
            _write_range(storage.data, data, cast.start - cast.base)
        return
    window, first = _window(cast, shape), cast.window_row
    if cast.kind == "block":
        grid = maxima.reshape(-(-shape[0] // _TILE), -(-shape[1] // _TILE))
        scale_inv = numerics.block_scale_inv(grid, power_2_scale=quantizer.power_2_scale,
                                             amax_epsilon=quantizer.amax_epsilon,
                                             input_dtype=torch.float32)
        if storage.rowwise_data is not None:
            storage.rowwise_scale_inv.copy_(scale_inv)
            if window.numel():
                data, _ = numerics.quantize_block_2d(
                    window, power_2_scale=quantizer.power_2_scale,
                    amax_epsilon=quantizer.amax_epsilon,
                    tile_amaxes=grid[first // _TILE:-(-(first + window.shape[0]) // _TILE)])
                _write_range(storage.rowwise_data, _range_of(data, cast, shape),
                             cast.start - cast.base)
        return
    if cast.kind == "nvfp4":
        _cast_nvfp4(cast, maxima, shape, window)
        return
    rows = shape[0] * (shape[1] // _MX_BLOCK)  # MXFP8: `maxima` holds the reduced exponents
    row_exponents = maxima[:rows].reshape(shape[0], shape[1] // _MX_BLOCK)
    column_exponents = maxima[rows:].reshape(shape[0] // _MX_BLOCK, shape[1])
    if storage.rowwise_data is not None:  # per-row scales: the rows the storage holds
        storage.rowwise_scale.copy_(_storage_rows(row_exponents, cast, shape,
                                                  storage.rowwise_data.shape[0]))
    if storage.columnwise_data is not None:  # the columnwise grid is whole (shared)
        storage.columnwise_scale.copy_(column_exponents)
    if not window.numel():
        return
    quantized = numerics.quantize_mxfp8(
        window, rowwise=storage.rowwise_data is not None,
        columnwise=storage.columnwise_data is not None, dtype=storage.fp8_dtype,
        rowwise_exponents=row_exponents[first:first + window.shape[0]],
        columnwise_exponents=column_exponents[first // _MX_BLOCK:
                                              (first + window.shape[0]) // _MX_BLOCK])
    for direction in ("rowwise", "columnwise"):
        if f"{direction}_data" in quantized:
            _write_range(getattr(storage, f"{direction}_data"),
                         _range_of(quantized[f"{direction}_data"], cast, shape),
                         cast.start - cast.base)


def _range_of(window_values: torch.Tensor, cast: _Cast, shape: tuple[int, int]) -> torch.Tensor:
    """This rank's range of the weight's elements, out of values laid out as its window."""
    offset = cast.start - cast.window_row * shape[1]
    return window_values.reshape(-1).narrow(0, offset, cast.master.numel())


def _storage_rows(full_rows: torch.Tensor, cast: _Cast, shape: tuple[int, int],
                  count: int) -> torch.Tensor:
    """The rows of a per-row tensor of the full weight that cast.storage holds (all of them for
    a full-size weight; an FSDP2 shard's own rows otherwise)."""
    first_row = cast.base // shape[1]
    return full_rows[first_row:first_row + count]


def _cast_nvfp4(cast: _Cast, maxima: torch.Tensor, shape: tuple[int, int],
                window: torch.Tensor) -> None:
    """2D NVFP4: global amax and 16x16 tile maxima reduced; the rank's elements are written
    nibble by nibble (element 2j is the low nibble of byte j, 2j+1 the high one), so a range
    that starts or ends inside a byte leaves the byte's other nibble as it was."""
    storage = cast.storage
    amax = maxima[:1].reshape(())
    grid = maxima[1:].reshape(shape[0] // _FP4_TILE, shape[1] // _FP4_TILE)
    target = storage.rowwise_data
    if target is None:
        raise ValueError("quantize_master_weights: this NVFP4 weight keeps no rowwise copy to "
                         "cast into; keep the rowwise usage of weights")
    scale = nvfp4_scale_2d(grid, amax)
    storage.rowwise_scale.copy_(_storage_rows(scale, cast, shape, target.shape[0]))
    storage.amax_rowwise.copy_(amax.reshape(storage.amax_rowwise.shape))
    if cast.master is None or cast.master.numel() == 0:
        return
    first = cast.window_row
    quantized = numerics.quantize_nvfp4(
        window, rowwise=True, two_dimensional=True, reduce_amax=lambda _: amax,
        tile_amaxes=grid[first // _FP4_TILE:(first + window.shape[0]) // _FP4_TILE])
    start, end = cast.start - cast.base, cast.start - cast.base + cast.master.numel()
    # byte j of the storage is byte base/2 + j of the weight, byte base/2 + j - first*K/2 of
    # the window (K is even: rows are whole bytes)
    shift = cast.base // 2 - first * shape[1] // 2
    source = quantized["rowwise_data"].view(-1)
    destination = target.view(-1)
    first_full, last_full = (start + 1) // 2, end // 2  # bytes wholly inside [start, end)
    if last_full > first_full:
        destination[first_full:last_full] = source[first_full + shift:last_full + shift].to(
            destination.device)
    if start % 2:  # the range starts at a high nibble
        byte = start // 2
        destination[byte] = (destination[byte] & 0x0F) | (source[byte + shift] & 0xF0)
    if end % 2:  # the range ends at a low nibble (never the byte of an odd start)
        byte = end // 2
        destination[byte] = (destination[byte] & 0xF0) | (source[byte + shift] & 0x0F)


def quantize_master_weights(
    model_weights: Sequence[torch.Tensor],
    master_weights: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int],
    group=None,
    fsdp_shard_model_weights: Sequence[torch.Tensor] | None = None,
    manual_post_all_gather_processing: bool = True,
) -> None:
    """Cast each rank's fp32 master shards into the quantized model weights, in place.

    model_weights[i]: a full-size QuantizedTensor weight (quantized_model_init), or the FSDP2
    parameter of one (enable_low_precision_all_gather shards its FP8 bytes: this rank writes its
    own rows; `fsdp_shard_model_weights` may name those parameters instead). master_weights[i]:
    this rank's flat shard of it (None when it owns none), covering elements
    [start_offsets[i], start_offsets[i] + numel) of the flattened weight; shards need not
    align with rows, tiles or blocks. group: the ranks that share the weights (the
    data-parallel group); one MAX all-reduce over it per call for all weights together (a
    second, of uint8 exponents, when MXFP8 weights are among them).

    Afterwards this rank's ranges of the rowwise bytes (and of MXFP8's columnwise bytes) and
    every scale of those copies are those of quantizing the full master weight; all-gather the
    ranges, then call post_all_gather_processing(model_weights) to rebuild the transposed
    copies, bytes and scales, of per-tensor FP8, block FP8 and 2D NVFP4 (with
    manual_post_all_gather_processing=False the stale transposed copies are dropped instead,
    and rebuilt from the rowwise bytes when a GEMM next asks for them).
    """
    if fsdp_shard_model_weights is not None:
        if len(fsdp_shard_model_weights) != len(model_weights):
            raise ValueError("fsdp_shard_model_weights must name one shard per model weight")
        model_weights = fsdp_shard_model_weights
    if not len(model_weights) == len(master_weights) == len(start_offsets):
        raise ValueError(
            f"model_weights, master_weights and start_offsets differ in length "
            f"({len(model_weights)}, {len(master_weights)}, {len(start_offsets)})")
    casts: list[tuple[_Cast, tuple[int, int]]] = []
    for index, (weight, master, start) in enumerate(
            zip(model_weights, master_weights, start_offsets, strict=True)):
        storage, base = _check(weight, master, int(start), index)
        for sub in cast_targets(storage):
            casts.append((_Cast(sub, None if master is None else master.detach(), int(start),
                                _kind(sub), base=base), _shape(weight)))
    if casts:
        _cast_from_reduced_maxima(casts, group)
    if not manual_post_all_gather_processing:
        for cast, _ in casts:
            _drop_derived_copies(cast.storage)


def _maxima_size(cast: _Cast, shape: tuple[int, int]) -> int:
    """Length of one weight's segment of the maxima vector (_partial_maxima's layout, which
    kernels/master_cast.py writes too)."""
    rows, columns = shape
    if cast.kind in ("current", "delayed"):
        return 1
    if cast.kind == "block":
        return -(-rows // _TILE) * -(-columns // _TILE)
    if cast.kind == "mxfp8":  # rowwise 1x32 maxima [M, K/32], then columnwise 32x1 [M/32, K]
        return rows * (columns // _MX_BLOCK) + (rows // _MX_BLOCK) * columns
    return 1 + (rows // _FP4_TILE) * (columns // _FP4_TILE)  # the global amax, then the tiles


def _cast_from_reduced_maxima(casts: list[tuple[_Cast, tuple[int, int]]], group) -> None:
    """One vector of every weight's partial maxima (fp32) and one of MXFP8's exponents
    (uint8), one MAX all-reduce over `group` each (when not empty), then the casts. Casts the
    kernels serve write their maxima and cast in a few launches per plan
    (master_cast_batched.plans); the others take the reference (torch) functions here."""
    sizes = {torch.float32: 0, torch.uint8: 0}
    for cast, shape in casts:
        dtype = torch.uint8 if cast.kind == "mxfp8" else torch.float32
        cast.offset, cast.count = sizes[dtype], _maxima_size(cast, shape)
        sizes[dtype] += cast.count
    device = _device(casts[0][0])
    vectors = {dtype: torch.zeros(size, dtype=dtype, device=device)
               for dtype, size in sizes.items()}

    def vector(kind: str) -> torch.Tensor:
        return vectors[torch.uint8 if kind == "mxfp8" else torch.float32]

    kernel_devices: dict = {}  # kernels.available per device, asked once per call
    served = [(cast, shape) for cast, shape in casts if plan_batchable(cast, kernel_devices)]
    plans = batched_plans([cast for cast, _ in served], [shape for _, shape in served]) \
        if served else []
    for plan in plans:
        plan.maxima(vector(plan.kind))
    done = {id(cast) for cast, _ in served}
    rest = [(cast, shape) for cast, shape in casts if id(cast) not in done]
    for cast, shape in rest:
        vector(cast.kind)[cast.offset:cast.offset + cast.count] = (
            _partial_maxima(cast, shape).reshape(-1))
    vectors = {dtype: all_reduce_max_keep_nan(values, group, in_place=True)
               if values.numel() else values for dtype, values in vectors.items()}
    for plan in plans:
        plan.cast(vector(plan.kind))
    for cast, shape in rest:
        _cast(cast, vector(cast.kind)[cast.offset:cast.offset + cast.count], shape)


def cast_master_weights_to_nvfp4(
    model_weights: Sequence[torch.Tensor],
    master_weights: Sequence[torch.Tensor | None],
    start_offsets: Sequence[int],
    group=None,
    fsdp_shard_model_weights: Sequence[torch.Tensor] | None = None,
) -> None:
    """quantize_master_weights for 2D NVFP4 weights only (seed 004's NVFP4 partial cast), under
    the seed's name: the global amax and the 16x16 tile maxima reduced over `group`, each rank's
    range written nibble by nibble. As the seed's review asked, a new API has no
    manual_post_all_gather_processing switch: call post_all_gather_processing(model_weights)
    after the all-gather, which rebuilds the transposed copies."""
    for index, weight in enumerate(model_weights):
        storage = weight.quantized_storage if isinstance(weight, QuantizedTensor) else None
        if not (isinstance(storage, NVFP4Storage) and storage.two_dimensional):
            raise TypeError(
                f"cast_master_weights_to_nvfp4: model_weights[{index}] is not a 2D NVFP4 weight "
                f"({storage!r} of {type(weight).__name__}); build the weights under "
                "quantized_model_init(recipe=NVFP4BlockScaling()), or use "
                "quantize_master_weights, which casts every format")
    quantize_master_weights(model_weights, master_weights, start_offsets, group,
                            fsdp_shard_model_weights=fsdp_shard_model_weights)


def cast_targets(storage) -> list:
    """The storages a weight's cast writes: the weight's own, or a hybrid weight's two
    sub-storages, each in its own format (seed 000).

    A hybrid's columnwise sub-storage holds only the transposed copy, whose layout does not
    follow the flat element ranges the ranks own. Where the format derives that copy from a
    rowwise one (per-tensor FP8, 128x128 blocks, 2D NVFP4), the sub-storage gets a rowwise
    copy (derived once, here) that the ranks write by range and the all-gather fills;
    post_all_gather_processing then rebuilds the transposed copy from it. The price: that
    sub-storage keeps both copies. MXFP8 writes its columnwise copy by range directly."""
    if not isinstance(storage, HybridStorage):
        return [storage]
    targets = []
    for columnwise, sub in ((False, storage.rowwise_storage),
                            (True, storage.columnwise_storage)):
        if sub is None:
            continue
        if columnwise and sub.derives_columnwise() and not sub.has_rowwise():
            sub.update_usage(rowwise=True)
        targets.append(sub)
    return targets


def _shape(weight: torch.Tensor) -> tuple[int, int]:
    """The 2D view [M, K] a weight is quantized as (numerics.blocks.as_2d's, without a
    tensor: this runs per weight and step)."""
    shape = tuple(weight.shape)
    if len(shape) < 2:
        return tuple(as_2d(torch.empty(shape, device="meta")).shape)
    columns = shape[-1]
    return (weight.numel() // columns if columns else math.prod(shape[:-1])), columns


def _drop_derived_copies(storage) -> None:
    """Drop transposed copies that the cast left stale (rebuilt on next use)."""
    if storage.derives_columnwise() and storage.has_rowwise():
        storage.update_usage(columnwise=False)


def post_all_gather_processing(model_weights: Sequence[torch.Tensor]) -> None:
    """After the all-gather of the rowwise bytes: rebuild the transposed (columnwise) copies of
    per-tensor FP8, block FP8 and 2D NVFP4 weights from them (NVFP4 with its nibbles
    repacked). MXFP8 writes both copies in the cast itself."""
    for weight in model_weights:
        storage = weight.quantized_storage if isinstance(weight, QuantizedTensor) else weight
        subs = ([storage.columnwise_storage] if isinstance(storage, HybridStorage)
                else [storage])  # a hybrid's rowwise sub-storage has no transposed copy
        for sub in subs:
            if (sub is not None and sub.derives_columnwise() and sub.has_columnwise()
                    and sub.has_rowwise()):
                sub._derive_columnwise()

