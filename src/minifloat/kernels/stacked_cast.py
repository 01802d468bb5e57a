"""The flat layout of a multi-tensor per-tensor FP8 cast (kernels.multi_tensor), importable
without Triton: the lean grouped GEMM path builds the same layout on the CPU, where the kernels
do not run, and reads both through this one class."""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_SLOT = 4  # fp32 scales per 16-byte slot: cuBLAS wants each FP8 GEMM's scale 16-byte aligned


class StackedCast(NamedTuple):
    """Per-tensor current scaling of many tensors, as flat buffers: each tensor's bytes follow
    the previous tensor's (offsets 16-byte aligned), so when every size is a multiple of 16
    bytes `data` is the tensors' concatenation, e.g. the rows of a grouped GEMM's operand
    [sum M, K] or the stacked experts' weights [E, N, K]."""

    data: torch.Tensor | None  # flat fp8 bytes of the rowwise copies
    data_t: torch.Tensor | None  # flat fp8 bytes of the columnwise copies (each [K, M])
    scale_inv: torch.Tensor  # fp32, one 16-byte slot per tensor
    offsets: list[int]  # each tensor's start in data / data_t
    shapes: list[tuple[int, int]]  # each tensor's [M, K]

    def scale(self, i: int) -> torch.Tensor:
        """Tensor i's scale_inv: a 1-element, 16-byte aligned view."""
        return self.scale_inv[i * SCALE_SLOT:i * SCALE_SLOT + 1]

    def scales(self) -> torch.Tensor:
        """Every tensor's scale_inv as a strided [n] view."""
        return self.scale_inv.view(-1, SCALE_SLOT)[:, 0]

    def rowwise(self, i: int) -> torch.Tensor:
        m, k = self.shapes[i]
        return self.data[self.offsets[i]:self.offsets[i] + m * k].view(m, k)

    def columnwise(self, i: int) -> torch.Tensor:
        m, k = self.shapes[i]
        return self.data_t[self.offsets[i]:self.offsets[i] + m * k].view(k, m)
