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
    cache: dict | None,
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


# The small-M rule (issue 21): inside quantize_weights_once, without autograd, a GEMM of at
# most this many rows runs in high precision against the weight dequantized once per block.
# Measured on one H200 (benchmarks/small_m.py, BENCHMARKS.md 2026-11-26 fourth session): at
# K=2048, N=2048 and 8192, M=1..256, the quantized path took 0.08-1.05 ms a call (the
# activation's cast and the scaled GEMM, bound by their launch cost; MXFP8 and NVFP4 emulated
# on Hopper), bf16 against the dequantized weight 0.010-0.020 ms: 4.7x to 100x faster at every
# M measured, for every recipe. Above it (prompts, batched evaluation) the recipe's quantized
# GEMM runs.
SMALL_M_ROWS = 256

# quantize_weights_once: how deeply nested, an epoch that every entry and exit moves on (so no
# kept quantization crosses the border of such a block in either direction), and the rows up
# to which the innermost block runs GEMMs against dequantized weights
_ONCE = {"depth": 0, "epoch": 0, "small_m_rows": SMALL_M_ROWS}
# Copies kept inside such a block live in a sub-cache of the module's cache, under this key:
# no call after the block can use them (the epoch moved on), so the outermost exit drops the
# sub-caches (_BLOCK_CACHES: the module caches holding one) instead of leaving a quantized and
# a dequantized copy of every weight alive in training after an evaluation or a generation,
# and copies that is_first_microbatch keeps in the module's cache itself survive the block
ONCE_KEY = "quantize_weights_once"
_BLOCK_CACHES: list[dict] = []


def once_cache(cache: dict) -> dict:
    """`cache`'s sub-cache for the copies of the current quantize_weights_once block."""
    sub = cache.get(ONCE_KEY)
    if sub is None:
        sub = cache[ONCE_KEY] = {}
        _BLOCK_CACHES.append(cache)
    return sub


@contextlib.contextmanager
def quantize_weights_once(small_m_rows: int = SMALL_M_ROWS) -> Iterator[None]:
    """Inside, each module quantizes each weight once and reuses that copy for every later
    call: generation (a prompt, then a forward per token) or evaluation, where the weights do
    not change. The caller vouches for that, as with TransformerEngine's
    `is_first_microbatch=False`: an optimizer step or a write to the weights inside the block
    is not seen. Kept copies are dropped from use when the block ends. Eager only (a compiled
    graph quantizes inside the graph).

    The small-M rule: a call of at most `small_m_rows` rows without autograd (a decode step)
    multiplies its high-precision input by the weight quantized once and dequantized once (the
    recipe's weight values, the input left unquantized), which is faster on the GPU than
    quantizing a few rows and launching a scaled GEMM (SMALL_M_ROWS says what was measured).
    The dequantized copies cost the memory of the high-precision weights while the block runs;
    `small_m_rows=0` keeps every call on the recipe's quantized path."""
    if small_m_rows < 0:
        raise ValueError(f"small_m_rows must be >= 0 (0 turns the small-M rule off), got "
                         f"{small_m_rows}")
    outer_rows = _ONCE["small_m_rows"]
    _ONCE["depth"] += 1
    _ONCE["epoch"] += 1
    _ONCE["small_m_rows"] = small_m_rows
    try:
        yield
    finally:
        _ONCE["depth"] -= 1
        _ONCE["epoch"] += 1
        _ONCE["small_m_rows"] = outer_rows
        if _ONCE["depth"] == 0:
            for cache in _BLOCK_CACHES:
                cache.pop(ONCE_KEY, None)
            _BLOCK_CACHES.clear()


def weights_quantized_once() -> bool:
    return _ONCE["depth"] > 0 and not torch.compiler.is_compiling()


def runs_dequantized(rows: int) -> bool:
    """Whether a call of `rows` rows takes the small-M rule (see quantize_weights_once)."""
    return (rows <= _ONCE["small_m_rows"] and not torch.is_grad_enabled()
            and weights_quantized_once())


def dequantized_weight(cache: dict, weight: torch.Tensor, quantizer: Quantizer,
                       dtype: torch.dtype) -> torch.Tensor:
    """The weight's rowwise quantization dequantized to `dtype`, made once per
    quantize_weights_once block (kept in the block's sub-cache of the module's `cache`, beside
    the quantized copy)."""
    cache = once_cache(cache)
    key = (weight._version, id(quantizer), quantizer.state_version(), _ONCE["epoch"], dtype)
    entry = cache.get(("dequantized", id(weight)))
    if entry is not None and entry["weight"]() is weight and entry["key"] == key:
        return entry["tensor"]
    storage = quantized_weight(cache, weight, quantizer, columnwise=False)
    tensor = storage.dequantize(dtype=dtype)
    cache[("dequantized", id(weight))] = {"weight": weakref.ref(weight), "key": key,
                                          "tensor": tensor}
    return tensor


def weight_cache_for(cache: dict, is_first_microbatch: bool | None
                     ) -> tuple[dict | None, bool]:
    """(cache, reuse) for quantized_weight from a forward's `is_first_microbatch` flag (None
    inside quantize_weights_once: reuse)."""
    if is_first_microbatch is None:
        return (once_cache(cache), True) if weights_quantized_once() else (None, False)
    return cache, not is_first_microbatch
