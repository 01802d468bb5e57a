"""What a state dict holds for weights that FSDP2 gathers in low precision, so that
torch.distributed.checkpoint (DCP) saves, reshards and loads them (issue 20, item 3).

Why: `enable_low_precision_all_gather` replaces such weights with tensor subclasses that only
FSDP2's gather understands. DCP would pickle a `LowPrecisionGatherWeight` whole (its quantizer
included, which `torch.load(weights_only=True)` then refuses) and cannot describe a
`QuantizedShardWeight` at all. The hooks installed here make each module's state dict hold:

- for a LowPrecisionGatherWeight: the high-precision values it wraps, a plain (D)Tensor, so the
  checkpoint is the one high-precision FSDP2 saves and loads into either mode;
- for a QuantizedShardWeight (quantized_model_init weights sharded as bytes): its bytes and
  scales, not dequantized: a dict {"rows0": ..., "rows1": ..., "shared": ...} whose row tensors
  (the rowwise bytes first; NVFP4's per-row scales; MXFP8's per-row scales and columnwise
  bytes) are uint8 DTensors sharded by rows like the weight, which DCP reshards to any number of
  ranks, and whose `shared` tensor (scale_inv, a tile grid, a global amax: equal on every rank)
  is saved once. Loading writes into the weight's own buffers.

`high_precision_state_dict(model)` is the export the issue asks for besides: every quantized
weight dequantized (a sharded one shard by shard), for plain PyTorch models or publication.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quantizers import QuantizedTensor
from .fsdp import LowPrecisionGatherWeight
from .quantized_shards import QuantizedShardWeight

_INSTALLED = "_minifloat_shard_state_dict_hooks"


def install_state_dict_hooks(module: nn.Module) -> None:
    """Make `module`'s state dict hold savable values for its wrapped weights (once)."""
    if getattr(module, _INSTALLED, False):
        return
    module.register_state_dict_post_hook(_savable_values)
    module.register_load_state_dict_pre_hook(_load_into_wrapped)
    setattr(module, _INSTALLED, True)


def _local(value: torch.Tensor) -> torch.Tensor:
    return getattr(value, "_local_tensor", value)


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's rows of a tensor with as many rows as `value`) as a DTensor placed
    like `value`, or itself when `value` is no DTensor."""
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    shape = (value.shape[0], *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, value.placements, run_check=False, shape=shape,
                              stride=stride)


def _savable_values(module: nn.Module, state_dict: dict, prefix: str, _metadata) -> None:
    for name, parameter in module.named_parameters(recurse=False):
        key = prefix + name
        local = _local(parameter)
        if key not in state_dict:
            continue
        if isinstance(local, LowPrecisionGatherWeight):
            state_dict[key] = _like(parameter, local._inner.detach())
        elif isinstance(local, QuantizedShardWeight):
            entry = {f"rows{index}": _like(parameter, rows)
                     for index, rows in enumerate(local._rows)}
            entry["shared"] = local._shared
            state_dict[key] = entry


def _load_into_wrapped(module: nn.Module, state_dict: dict, prefix: str, _metadata, _strict,
                       _missing, _unexpected, error_msgs: list) -> None:
    for name, parameter in module.named_parameters(recurse=False):
        key = prefix + name
        local = _local(parameter)
        if not isinstance(local, QuantizedShardWeight) or key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, dict) or set(value) != {
                *(f"rows{i}" for i in range(len(local._rows))), "shared"}:
            error_msgs.append(
                f"{key}: a quantized weight sharded as bytes loads from the bytes-and-scales "
                f"entry its own state dict holds ({len(local._rows)} row tensors and 'shared'), "
                f"got {type(value).__name__}; save the checkpoint from a model built the same "
                "way (quantized_model_init, enable_low_precision_all_gather), or load "
                "high-precision values into a model built without quantized_model_init")
            continue
        with torch.no_grad():
            for index, rows in enumerate(local._rows):
                source = _local(value[f"rows{index}"])
                if source.shape != rows.shape:
                    error_msgs.append(f"{key}: row tensor {index} has shape "
                                      f"{tuple(source.shape)}, this shard {tuple(rows.shape)}")
                    continue
                if source.data_ptr() != rows.data_ptr():  # DCP loads in place: often the same
                    rows.copy_(source)
            local._shared.copy_(_local(value["shared"]))
        state_dict[key] = parameter  # loaded above; the module's copy_ is then a no-op


def high_precision_state_dict(model: nn.Module, dtype: torch.dtype | None = None,
                              keep_recipe_state: bool = False) -> dict:
    """model.state_dict() with every quantized weight dequantized (to `dtype`, default the
    weight's nominal dtype): QuantizedTensor weights, and weights sharded as bytes under FSDP2
    (as DTensors of their dequantized rows, so DCP saves them like any sharded weight). Each
    module's `_extra_state` (recipe state) is dropped unless keep_recipe_state. The result
    loads into the same model built without quantized_model_init, or into plain torch.nn."""
    state = model.state_dict()
    parameters = dict(model.named_parameters())
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state") and not keep_recipe_state:
            continue
        parameter = parameters.get(key)
        local = _local(parameter) if parameter is not None else None
        if isinstance(local, QuantizedShardWeight):
            rows = local.shard_storage().dequantize(dtype)
            out[key] = _like(parameter, rows)
        elif isinstance(value, QuantizedTensor):
            out[key] = value.dequantize(dtype)
        elif isinstance(value, torch.Tensor) and dtype is not None and value.is_floating_point():
            out[key] = value.detach().to(dtype)
        else:
            out[key] = value
    return out
