"""What the GPU kernel tests compare FP8 bytes by, shared by their files."""

from __future__ import annotations

import torch


def canonical_nan(codes: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes with every NaN code as 0x7F: NaN's sign is no part of the contract (CPU
    arithmetic keeps an input NaN's sign in x * scale, CUDA's returns the canonical NaN)."""
    magnitude = codes & 0x7F
    nan = magnitude == 0x7F if fp8_dtype == torch.float8_e4m3fn else magnitude > 0x7C
    return torch.where(nan, torch.full_like(codes, 0x7F), codes)
