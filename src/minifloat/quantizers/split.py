"""split_quantize: quantize the row splits of one tensor (one per expert) in one call.

GroupedLinear hands its whole [M, K] input and the token count of each expert; each split gets
its own quantizer (its own scale, its own amax). Zero-size splits give None: there is nothing to
quantize and their GEMMs produce empty outputs and zero weight gradients. On CUDA this is where
a multi-tensor kernel serves all splits with one launch; elsewhere it runs split by split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import QuantizedStorage, Quantizer


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


def split_quantize(
    x: torch.Tensor, m_splits: Sequence[int], quantizers: Sequence[Quantizer]
) -> list[QuantizedStorage | torch.Tensor | None]:
    """Quantize x[rows of split i] with quantizers[i], for every split; None for empty splits."""
    splits = check_splits(x.shape[0], m_splits, len(quantizers))
    pieces = torch.split(x, splits)
    return [
        None if rows == 0 else quantizer(piece)
        for rows, piece, quantizer in zip(splits, pieces, quantizers, strict=True)
    ]
