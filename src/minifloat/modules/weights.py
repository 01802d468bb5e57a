"""The quantized copy of a weight for one forward: cached, and with usages never removed.

Two kinds of weight reach a GEMM module:
- a high-precision parameter: quantized by the module's weight quantizer on every forward, unless
  the caller says the weight has not changed since the last one, as TransformerEngine users do
  with `is_first_microbatch`: True quantizes and keeps the copy, False reuses the kept copy
  (micro-batches of one step), None (the default) quantizes and keeps nothing. The weight's
  version counter alone cannot tell: fused optimizers (torch.optim.AdamW(fused=True)) and
  writes through `.data` change a parameter without bumping it, and a cache trusting it trained
  on stale quantized weights (the H100 GPT benchmark showed it: FP8 losses stalled);
- a QuantizedTensor parameter (quantized_model_init): it is its own copy. The module first
  configures its weight quantizer completely (rowwise always, columnwise when grad is enabled),
  then OR-merges those usages into the quantizer recorded on the weight, and makes the weight
  hold the copies asked for. A usage is never removed: the weight lives across steps, and a
  no-grad validation step must not strip the columnwise copy the next training step's dgrad
  needs, nor leave it stale (seed 002).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from ..quantizers import QuantizedStorage, QuantizedTensor, Quantizer, as_storage


def configure_weight_quantizer(quantizer: Quantizer, *, columnwise: bool) -> None:
    """Step one: the module's weight quantizer, configured completely for this forward."""
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    quantizer.internal = True


def merge_weight_usages(storage: QuantizedStorage, quantizer: Quantizer) -> None:
    """Step two: OR-merge `quantizer`'s usages into the quantizer recorded on a quantized weight
    (future casts, e.g. the optimizer step's requantization, follow it); never remove one."""
    recorded = storage.quantizer
    if recorded is None:
        return
    merged = recorded.copy()
    merged.amax_reduction_group = None
    merged.set_usage(
        rowwise=recorded.rowwise_usage or quantizer.rowwise_usage,
        columnwise=recorded.columnwise_usage or quantizer.columnwise_usage,
    )
    storage.quantizer = merged


def quantized_weight(
    cache: dict[int, dict] | None,
    weight: torch.Tensor,
    quantizer: Quantizer,
    *,
    columnwise: bool,
    reuse: bool = True,
) -> QuantizedStorage:
    """The weight's quantized storage with a rowwise copy (and a columnwise one if asked).

    `cache` maps id(weight) to the last kept quantization of a high-precision weight (None:
    quantize and keep nothing). With `reuse`, a kept entry serves while the weight's version
    counter and the quantizer's state are unchanged (the caller vouches that the weight did not
    change unseen); without it the weight is quantized afresh and the entry replaced.
    """
    configure_weight_quantizer(quantizer, columnwise=columnwise)
    if isinstance(weight, QuantizedTensor):
        storage = as_storage(weight)
        merge_weight_usages(storage, quantizer)
        storage.update_usage(rowwise=True, columnwise=True if columnwise else None)
        return storage
    if cache is None:
        return quantizer(weight.detach())
    key = (weight._version, id(quantizer), quantizer.state_version(), _ONCE["epoch"])
    entry = cache.get(id(weight))
    if reuse and entry is not None and entry["weight"]() is weight and entry["key"] == key:
        storage = entry["storage"]
        if not columnwise or storage.has_columnwise():
            return storage
    storage = quantizer(weight.detach())
    cache[id(weight)] = {"weight": weakref.ref(weight), "key": key, "storage": storage}
    return storage


# quantize_weights_once: how deeply nested, and an epoch that every entry and exit moves on,
# so no kept quantization crosses the border of such a block in either direction
_ONCE = {"depth": 0, "epoch": 0}


@contextlib.contextmanager
def quantize_weights_once() -> Iterator[None]:
    """Inside, each module quantizes each weight once and reuses that copy for every later
    call: generation (a prompt, then a forward per token) or evaluation, where the weights do
    not change. The caller vouches for that, as with TransformerEngine's
    `is_first_microbatch=False`: an optimizer step or a write to the weights inside the block
    is not seen. Kept copies are dropped from use when the block ends. Eager only (a compiled
    graph quantizes inside the graph)."""
    _ONCE["depth"] += 1
    _ONCE["epoch"] += 1
    try:
        yield
    finally:
        _ONCE["depth"] -= 1
        _ONCE["epoch"] += 1


def weights_quantized_once() -> bool:
    return _ONCE["depth"] > 0 and not torch.compiler.is_compiling()


def weight_cache_for(cache: dict[int, dict], is_first_microbatch: bool | None
                     ) -> tuple[dict[int, dict] | None, bool]:
    """(cache, reuse) for quantized_weight from a forward's `is_first_microbatch` flag (None
    inside quantize_weights_once: reuse)."""
    if is_first_microbatch is None:
        return (cache, True) if weights_quantized_once() else (None, False)
    return cache, not is_first_microbatch
