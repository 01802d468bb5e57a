"""FP8 block scaling with 128-element blocks, 1D or 2D (NUMERICS.md §4).

1D quantizes each direction from high precision (the columnwise copy is x^T in runs along M);
2D weights keep one scale per 128x128 tile, so either copy is the transpose of the other.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import kernels, numerics
from ..numerics.blocks import as_2d
from .base import QuantizedStorage, Quantizer, kernel_module
from .float8 import transposed


class Float8BlockStorage(QuantizedStorage):
    """Block-scaled FP8. Rowwise data [M, K]; columnwise data [K, M]; fp32 scale_inv grids as
    described in numerics/block_fp8.py."""

    rowwise_fields = ("rowwise_data", "rowwise_scale_inv")
    columnwise_fields = ("columnwise_data", "columnwise_scale_inv")
    metadata_fields = ("block_scaling_dim",)
    format_name: ClassVar[str] = "FP8 block scaling"

    def _dequantize(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype=None) -> torch.Tensor:
        dtype = torch.float32 if dtype is None else dtype
        if self.block_scaling_dim == 2:
            return numerics.dequantize_block_2d(data, scale_inv, dtype)
        return numerics.dequantize_block_1d(data, scale_inv, dtype)

    def _dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        if self.has_rowwise():
            return self._dequantize(self.rowwise_data, self.rowwise_scale_inv, dtype)
        return self._dequantize(self.columnwise_data, self.columnwise_scale_inv, dtype).t()

    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dequantized blocks with the reduction dim last ([M, K] or [K, M])."""
        if columnwise:
            return self._dequantize(self.columnwise_data, self.columnwise_scale_inv, None), None
        return self._dequantize(self.rowwise_data, self.rowwise_scale_inv, None), None

    def _derive_rowwise(self) -> None:
        if self.block_scaling_dim != 2:
            super()._derive_rowwise()
        self.rowwise_data = transposed(self.columnwise_data)
        self.rowwise_scale_inv = self.columnwise_scale_inv.t().contiguous()

    def _derive_columnwise(self) -> None:
        if self.block_scaling_dim != 2:
            super()._derive_columnwise()
        # transpose_block_2d's copies, the bytes through the tiled kernel where it runs
        self.columnwise_data = transposed(self.rowwise_data)
        self.columnwise_scale_inv = self.rowwise_scale_inv.t().contiguous()

    def derives_columnwise(self) -> bool:
        return self.block_scaling_dim == 2


class Float8BlockQuantizer(Quantizer):
    """DeepSeek-style FP8 (E4M3) with 1x128 blocks (block_scaling_dim=1, inputs and gradients)
    or 128x128 tiles (block_scaling_dim=2, weights). Edge blocks may be partial."""

    storage_class = Float8BlockStorage

    def fast_gemm_row_multiple(self) -> int:
        return 128  # blockwise scaled_mm (gemm_paths.blockwise_scaled_mm_applies)

    def __init__(
        self,
        block_scaling_dim: int = 1,
        *,
        power_2_scale: bool = True,
        amax_epsilon: float = 0.0,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        if block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim}")
        if fp8_dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 block scaling uses E4M3 elements only, got {fp8_dtype}")
        if amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon}")
        self.block_scaling_dim = block_scaling_dim
        self.power_2_scale = power_2_scale
        self.amax_epsilon = amax_epsilon
        self.fp8_dtype = fp8_dtype

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> Float8BlockStorage:
        options = {"power_2_scale": self.power_2_scale, "amax_epsilon": self.amax_epsilon}
        fields: dict[str, torch.Tensor | None] = {}
        if kernels.available(x):
            block_fp8 = kernel_module("block_fp8")  # Triton: fast path only
            if block_fp8.kernel_input(x):
                quantize = (block_fp8.quantize_block_2d if self.block_scaling_dim == 2
                            else block_fp8.quantize_block_1d)
                (fields["rowwise_data"], fields["rowwise_scale_inv"], fields["columnwise_data"],
                 fields["columnwise_scale_inv"]) = quantize(
                    x, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage, **options)
        if not fields and self.block_scaling_dim == 2:
            data, scale_inv = numerics.quantize_block_2d(x, **options)
            if self.rowwise_usage:
                fields["rowwise_data"], fields["rowwise_scale_inv"] = data, scale_inv
            if self.columnwise_usage:
                fields["columnwise_data"], fields["columnwise_scale_inv"] = (
                    numerics.transpose_block_2d(data, scale_inv)
                )
        elif not fields:
            x2d = as_2d(x)
            if self.rowwise_usage:
                fields["rowwise_data"], fields["rowwise_scale_inv"] = (
                    numerics.quantize_block_1d(x2d, **options)
                )
            if self.columnwise_usage:
                fields["columnwise_data"], fields["columnwise_scale_inv"] = (
                    numerics.quantize_block_1d_columnwise(x2d, **options)
                )
        return Float8BlockStorage(
            shape=x.shape,
            dtype=x.dtype,
            quantizer=owner,
            block_scaling_dim=self.block_scaling_dim,
            **fields,
        )
