"""MXFP8: 32-element blocks with E8M0 scales (NUMERICS.md §5).

Both copies use the [M, K] layout: rowwise blocks run along K, columnwise blocks along M. Neither
derives from the other; each is quantized from high precision in the same call.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from .. import kernels, numerics
from ..numerics.blocks import require_divisible
from ..numerics.mxfp8 import BLOCK
from .base import QuantizedStorage, Quantizer, kernel_module

KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MXFP8Storage(QuantizedStorage):
    """Rowwise data [M, K] + E8M0 scale [M, K/32]; columnwise data [M, K] + scale [M/32, K]."""

    rowwise_fields = ("rowwise_data", "rowwise_scale")
    columnwise_fields = ("columnwise_data", "columnwise_scale")
    metadata_fields = ("fp8_dtype",)
    format_name: ClassVar[str] = "MXFP8"

    def _dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        if self.has_rowwise():
            return numerics.dequantize_mxfp8(self.rowwise_data, self.rowwise_scale, dtype=dtype)
        return numerics.dequantize_mxfp8(
            self.columnwise_data, self.columnwise_scale, columnwise=True, dtype=dtype
        )


    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dequantized values (exact) with the reduction dim last: x, or x^T for columnwise.

        With the kernels (CUDA): bf16 in one pass, contiguous (x^T transposed in the kernel),
        equal to the reference's values cast to bf16 (exact for block scales >= 2^-118)."""
        data = self.columnwise_data if columnwise else self.rowwise_data
        if kernels.available(data):
            scale = self.columnwise_scale if columnwise else self.rowwise_scale
            return kernel_module("dequantize").dequantize_mxfp8_bf16(  # Triton: fast path only
                data, scale, columnwise=columnwise), None
        if columnwise:
            values = numerics.dequantize_mxfp8(
                self.columnwise_data, self.columnwise_scale, columnwise=True
            )
            return values.t(), None
        return numerics.dequantize_mxfp8(self.rowwise_data, self.rowwise_scale), None


class MXFP8Quantizer(Quantizer):
    """MXFP8 with E4M3 elements (E5M2 allowed); M and K must be multiples of 32."""

    storage_class = MXFP8Storage

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        numerics.fp8_format(fp8_dtype)
        self.fp8_dtype = fp8_dtype

    def check_shape(self, shape: tuple[int, ...]) -> None:
        super().check_shape(shape)
        k = shape[-1]
        require_divisible((math.prod(shape) // k if k else 0, k), BLOCK, "MXFP8")

    def row_multiple(self) -> int:
        return BLOCK

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> MXFP8Storage:
        quantize = numerics.quantize_mxfp8
        if kernels.available(x) and x.is_contiguous() and x.dtype in KERNEL_INPUT_DTYPES:
            quantize = kernel_module("mxfp8").quantize_mxfp8  # Triton: fast path only
        buffers = quantize(
            x, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage, dtype=self.fp8_dtype
        )
        return MXFP8Storage(
            shape=x.shape, dtype=x.dtype, quantizer=owner, fp8_dtype=self.fp8_dtype,
            **buffers,
        )
