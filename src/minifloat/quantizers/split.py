"""split_quantize: quantize the row splits of one tensor (one per expert) in one call.

GroupedLinear hands its whole [M, K] input and the token count of each expert; each split gets
its own quantizer (its own scale, its own amax). Zero-size splits give None: there is nothing to
quantize and their GEMMs produce empty outputs and zero weight gradients.

Where the Triton kernels serve the input and every non-empty split's quantizer has one
configuration the multi-tensor kernels know (FP8 current scaling, FP8 1x128 blocks, NVFP4 1D,
MXFP8), all splits are quantized by one kernel call (split_kernels.py has the exact rules) with
the bytes of the per-split loop; every other case runs the loop, split by split.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .base import QuantizedStorage, Quantizer
from .split_kernels import plan_multi, run_plan


def check_splits(rows: int, m_splits: Sequence[int], count: int) -> list[int]:
    """Validate m_splits against the row count and the number of GEMMs; returns a list."""
    splits = [int(m) for m in m_splits]
    if len(splits) != count:
        raise ValueError(f"m_splits has {len(splits)} entries for {count} GEMMs; give one token "
                         "count per expert")
    if any(m < 0 for m in splits):
        raise ValueError(f"m_splits must be >= 0, got {splits}")
    if sum(splits) != rows:
        raise ValueError(
            f"m_splits sum to {sum(splits)} but the input has {rows} rows; the splits must "
            "cover the input exactly"
        )
    return splits


def loop_forced() -> bool:
    """MINIFLOAT_SPLIT_LOOP=1: always quantize split by split (to compare, or to rule the
    multi-tensor kernels out while debugging)."""
    return os.environ.get("MINIFLOAT_SPLIT_LOOP", "0") == "1"


def split_quantize(
    x: torch.Tensor, m_splits: Sequence[int], quantizers: Sequence[Quantizer], *,
    loop: bool = False,
) -> list[QuantizedStorage | torch.Tensor | None]:
    """Quantize x[rows of split i] with quantizers[i], for every split; None for empty splits.

    Each result is what `quantizers[i](split i)` returns (a QuantizedTensor, or the storage when
    the quantizer is internal). When two or more splits hold rows and the multi-tensor kernels
    can serve every one of them, one kernel call quantizes all of them, byte for byte as the
    loop would (stochastic rounding aside: its random bits come from one draw for all splits).
    `loop=True`, or the environment variable MINIFLOAT_SPLIT_LOOP=1, forces the per-split loop.
    """
    if (type(m_splits) in (list, tuple) and len(m_splits) == 1 and len(quantizers) == 1
            and type(m_splits[0]) is int and m_splits[0] == x.shape[0]):
        # a Linear: the whole tensor, no split views, no list checks (host time per call);
        # anything else, errors included, goes through check_splits below
        return [quantizers[0](x) if x.shape[0] else None]
    splits = check_splits(x.shape[0], m_splits, len(quantizers))
    if len(splits) == 1:
        return [quantizers[0](x) if splits[0] else None]
    if sum(1 for rows in splits if rows) > 1 and not (loop or loop_forced()):
        # one split alone takes its quantizer's own single-tensor kernels: a multi-tensor
        # launch would only add the table upload (and its tiles suit small tensors)
        plan = plan_multi(x, splits, quantizers)
        if plan is not None:
            return run_plan(plan, len(splits))
    pieces = torch.split(x, splits)
    return [
        None if rows == 0 else quantizer(piece)
        for rows, piece, quantizer in zip(splits, pieces, quantizers, strict=True)
    ]
