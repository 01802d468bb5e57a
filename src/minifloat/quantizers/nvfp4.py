"""NVFP4: E2M1 elements, UE4M3 scales per 16 elements and an fp32 global scale (NUMERICS.md §6).

Weights use 16x16 tiles (2D), whose columnwise copy is the exact nibble transpose of the rowwise
one. Inputs and gradients use 1x16 blocks, optionally with the random Hadamard transform on the
columnwise copy and stochastic rounding (gradients); those copies are quantized independently.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from .. import kernels, numerics
from ..numerics.blocks import require_divisible
from ..numerics.nvfp4 import BLOCK, transpose_scale_2d
from .base import QuantizedStorage, Quantizer, kernel_module

KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NVFP4Storage(QuantizedStorage):
    """Rowwise data [M, K/2] + scale [M, K/16] + amax_rowwise; columnwise data [K, M/2] + scale
    [K, M/16] + amax_columnwise (the amax after the RHT when `with_rht`)."""

    rowwise_fields = ("rowwise_data", "rowwise_scale", "amax_rowwise")
    columnwise_fields = ("columnwise_data", "columnwise_scale", "amax_columnwise")
    metadata_fields = ("two_dimensional", "with_rht")
    format_name: ClassVar[str] = "NVFP4"

    def _dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        if self.has_rowwise():
            return numerics.dequantize_nvfp4(
                self.rowwise_data, self.rowwise_scale, self.amax_rowwise, dtype
            )
        values_t = numerics.dequantize_nvfp4(
            self.columnwise_data, self.columnwise_scale, self.amax_columnwise
        )
        if self.with_rht:
            # Only the RHT's inverse recovers x^T; this is close to, not bit-equal with, x^T.
            values_t = numerics.inverse_random_hadamard_transform(values_t)
        return values_t.t().to(dtype)

    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q * s_b (exact) with the reduction dim last; S_dec goes to the GEMM's alpha.

        The columnwise operand of an RHT tensor is RHT(x^T): only another RHT operand may meet it.
        With the kernels (CUDA) the values come as bf16 in one pass (exact: q * s_b has at most
        6 significant bits), and S_dec from the same launch.
        """
        data = self.columnwise_data if columnwise else self.rowwise_data
        if kernels.available(data):  # Triton: fast path only
            scale = self.columnwise_scale if columnwise else self.rowwise_scale
            amax = self.amax_columnwise if columnwise else self.amax_rowwise
            return kernel_module("dequantize").dequantize_nvfp4_operand(data, scale, amax)
        if columnwise:
            values = numerics.dequantize_nvfp4_blocks(self.columnwise_data, self.columnwise_scale)
            return values, numerics.global_decode_scale(self.amax_columnwise)
        values = numerics.dequantize_nvfp4_blocks(self.rowwise_data, self.rowwise_scale)
        return values, numerics.global_decode_scale(self.amax_rowwise)

    def _derive_rowwise(self) -> None:
        if not self.two_dimensional:
            super()._derive_rowwise()
        self.rowwise_data, self.rowwise_scale = _transposed_2d(self.columnwise_data,
                                                               self.columnwise_scale)
        self.amax_rowwise = self.amax_columnwise.clone()

    def _derive_columnwise(self) -> None:
        if not self.two_dimensional:
            super()._derive_columnwise()
        self.columnwise_data, self.columnwise_scale = _transposed_2d(self.rowwise_data,
                                                                     self.rowwise_scale)
        self.amax_columnwise = self.amax_rowwise.clone()

    def derives_columnwise(self) -> bool:
        return self.two_dimensional and not self.with_rht


def _transposed_2d(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """numerics.transpose_nvfp4_2d: the nibbles in one tiled pass where the kernels run
    (kernels/transpose.py; five torch passes otherwise), the scale layout by torch."""
    if kernels.available(data) and data.is_contiguous():
        return (kernel_module("transpose").transpose_nibbles(data),
                transpose_scale_2d(scale))
    return numerics.transpose_nvfp4_2d(data, scale)


class NVFP4Quantizer(Quantizer):
    """NVFP4 quantizer. M and K must be multiples of 16.

    with_2d_quantization: 16x16 tiles (weights); with_rht: Hadamard transform on the columnwise
    copy (1D only); stochastic_rounding: SR on both copies (gradients), drawn from torch's
    generator (reproducible under torch.manual_seed).
    """

    storage_class = NVFP4Storage

    def __init__(
        self,
        *,
        with_rht: bool = False,
        stochastic_rounding: bool = False,
        with_2d_quantization: bool = False,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        if with_rht and with_2d_quantization:
            raise ValueError(
                "NVFP4 2D (weight) quantization takes no RHT: set with_rht=False or "
                "with_2d_quantization=False"
            )
        self.with_rht = with_rht
        self.stochastic_rounding = stochastic_rounding
        self.with_2d_quantization = with_2d_quantization

    def check_shape(self, shape: tuple[int, ...]) -> None:
        super().check_shape(shape)
        k = shape[-1]
        require_divisible((math.prod(shape) // k if k else 0, k), BLOCK, "NVFP4")

    def row_multiple(self) -> int:
        return BLOCK

    def is_requantization_safe(self) -> bool:
        return not self.stochastic_rounding

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> NVFP4Storage:
        quantize = numerics.quantize_nvfp4
        if kernels.available(x) and x.is_contiguous() and x.dtype in KERNEL_INPUT_DTYPES:
            # Triton (fast path only); it applies reduce_amax to the device amax between kernels
            quantize = kernel_module("nvfp4").quantize_nvfp4
        buffers = quantize(
            x,
            rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage,
            two_dimensional=self.with_2d_quantization,
            with_rht=self.with_rht,
            stochastic_rounding=self.stochastic_rounding,
            reduce_amax=self.reduce_amax,
        )
        return NVFP4Storage(
            shape=x.shape,
            dtype=x.dtype,
            quantizer=owner,
            two_dimensional=self.with_2d_quantization,
            with_rht=self.with_rht,
            **buffers,
        )
