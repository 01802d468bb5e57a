"""IdentityQuantizer: an explicit high-precision passthrough for a tensor slot.

Used where a recipe keeps an operand in high precision (first and last layers of an NVFP4 run, a
hybrid direction left unquantized). The storage holds the tensor itself, optionally cast; both
directions share it, since a high-precision operand serves every GEMM as it is.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import QuantizedStorage, Quantizer


class IdentityStorage(QuantizedStorage):
    """High-precision values [M, K]; the rowwise and columnwise copies are the same tensor."""

    rowwise_fields = ("rowwise_data",)
    columnwise_fields = ("columnwise_data",)
    format_name: ClassVar[str] = "high precision"

    def _dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        data = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data
        return data.to(dtype)

    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        data = self.columnwise_data if columnwise else self.rowwise_data
        return (data.t() if columnwise else data), None

    def _derive_rowwise(self) -> None:
        self.rowwise_data = self.columnwise_data

    def _derive_columnwise(self) -> None:
        self.columnwise_data = self.rowwise_data


class IdentityQuantizer(Quantizer):
    """Passthrough: keeps values as they are, cast to `dtype` when one is given."""

    storage_class = IdentityStorage

    def __init__(
        self,
        dtype: torch.dtype | None = None,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"IdentityQuantizer keeps high precision: dtype must be float32, bfloat16, "
                f"float16 or None, got {dtype}"
            )
        self.dtype = dtype

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> IdentityStorage:
        dtype = x.dtype if self.dtype is None else self.dtype
        # a copy, never a view: in-place updates of the result must not reach the caller's x
        values = x.reshape(-1, x.shape[-1]).to(dtype=dtype, copy=True)
        return IdentityStorage(
            shape=x.shape,
            dtype=dtype,
            quantizer=owner,
            rowwise_data=values if self.rowwise_usage else None,
            columnwise_data=values if self.columnwise_usage else None,
        )
