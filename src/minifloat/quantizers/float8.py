"""Per-tensor FP8: delayed scaling (Float8Quantizer) and current scaling (NUMERICS.md §2, §3).

Both produce a Float8Storage: rowwise data [M, K], its byte transpose [K, M] as the columnwise
copy, and one scale_inv shared by both (so either copy derives the other exactly).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .. import kernels, numerics
from .base import QuantizedStorage, Quantizer, kernel_module


class Float8Storage(QuantizedStorage):
    """Per-tensor scaled FP8: `data` [M, K], `data_transpose` [K, M], `scale_inv` (1 element)."""

    rowwise_fields = ("data",)
    columnwise_fields = ("data_transpose",)
    shared_fields = ("scale_inv",)
    metadata_fields = ("fp8_dtype",)
    format_name: ClassVar[str] = "per-tensor FP8"

    def _dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        data = self.data if self.data is not None else self.data_transpose.t()
        return numerics.dequantize_per_tensor(data, self.scale_inv, dtype)

    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Exact fp8 values with K last (x or x^T); scale_inv goes to the GEMM's alpha."""
        data = self.data_transpose if columnwise else self.data
        return data.float(), self.scale_inv

    def _derive_rowwise(self) -> None:
        self.data = transposed(self.data_transpose)

    def _derive_columnwise(self) -> None:
        self.data_transpose = transposed(self.data)

    def derives_columnwise(self) -> bool:
        return True


def transposed(data: torch.Tensor) -> torch.Tensor:
    """data.t().contiguous() of FP8 bytes: a tiled Triton transpose where the kernels run
    (torch's strided copy moved these bytes at about 0.5 TB/s on an H200, kernels/transpose.py),
    torch's copy elsewhere (the CPU, tracing)."""
    if kernels.available(data) and data.dim() == 2 and data.is_contiguous():
        return kernel_module("transpose").transpose_bytes(data)
    return data.t().contiguous()


def _per_tensor_storage(
    quantizer: Quantizer,
    owner: Quantizer,
    x: torch.Tensor,
    data: torch.Tensor | None,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    data_transpose: torch.Tensor | None = None,
) -> Float8Storage:
    """Lay out the requested copies of per-tensor data quantized over the [M, K] view (a kernel
    hands over the transpose it wrote; otherwise it is taken from the data here)."""
    # reshapes only where needed: a kernel already hands over [M, K] data and a [1] scale_inv
    data2d = data if data is None or data.dim() == 2 else data.reshape(-1, x.shape[-1])
    if data_transpose is None and quantizer.columnwise_usage:
        data_transpose = transposed(data2d)
    return Float8Storage(
        shape=x.shape,
        dtype=x.dtype,
        quantizer=owner,
        data=data2d if quantizer.rowwise_usage else None,
        data_transpose=data_transpose if quantizer.columnwise_usage else None,
        scale_inv=scale_inv if scale_inv.dim() == 1 else scale_inv.reshape(1),
        fp8_dtype=fp8_dtype,
    )


class Float8Quantizer(Quantizer):
    """Delayed scaling: casts with a scale from earlier steps and records this tensor's amax.

    `scale` and `amax` are 1-element fp32 device tensors owned by the recipe state (shared, not
    copied, by copy()). Each call folds max|x| into `amax`; the recipe state turns the history into
    the next scale (NUMERICS.md §3).
    """

    storage_class = Float8Storage

    def fast_gemm_row_multiple(self) -> int:
        return 16  # torch._scaled_mm (gemm_paths.scaled_mm_applies)

    def __init__(
        self,
        scale: torch.Tensor,
        amax: torch.Tensor,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        numerics.fp8_format(fp8_dtype)  # validates the dtype
        if scale.numel() != 1 or amax.numel() != 1:
            raise ValueError(
                "Float8Quantizer needs 1-element scale and amax tensors (one slot of the recipe "
                f"state); got {scale.numel()} and {amax.numel()} elements"
            )
        self.scale = scale
        self.amax = amax
        self.fp8_dtype = fp8_dtype

    def state_version(self) -> int:
        return self.scale._version

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> Float8Storage:
        if kernels.available(x):
            per_tensor_fp8 = kernel_module("per_tensor_fp8")  # Triton: fast path only
            if per_tensor_fp8.kernel_input(x, self.scale, self.amax):
                data, data_t, scale_inv = per_tensor_fp8.quantize_delayed_scaling(
                    x, self.scale, self.amax, self.fp8_dtype,
                    rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                )
                return _per_tensor_storage(self, owner, x, data, scale_inv, self.fp8_dtype,
                                           data_t)
        amax = numerics.compute_amax(x).to(self.amax.device)
        self.amax.copy_(torch.maximum(self.amax, amax.reshape(self.amax.shape)))
        scale = self.scale.to(x.device)
        data, scale_inv = numerics.quantize_with_scale(x, scale, self.fp8_dtype)
        return _per_tensor_storage(self, owner, x, data, scale_inv, self.fp8_dtype)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: the scale comes from this tensor's own amax (reduced across a group when
    one is set for this call)."""

    storage_class = Float8Storage

    def fast_gemm_row_multiple(self) -> int:
        return 16  # torch._scaled_mm (gemm_paths.scaled_mm_applies)

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        amax_epsilon: float = 0.0,
        power_2_scale: bool = False,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        numerics.fp8_format(fp8_dtype)
        if amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {amax_epsilon}")
        self.fp8_dtype = fp8_dtype
        self.amax_epsilon = amax_epsilon
        self.power_2_scale = power_2_scale

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> Float8Storage:
        if kernels.available(x):
            per_tensor_fp8 = kernel_module("per_tensor_fp8")  # Triton: fast path only
            if per_tensor_fp8.kernel_input(x):
                # without a reduction group the cast kernel reduces the amax pass's partial
                # maxima itself (amax=None): one allocation and one launch fewer per call
                amax = (None if self.amax_reduction_group is None
                        else self.reduce_amax(kernel_module("amax").compute_amax(x)))
                data, data_t, scale_inv = per_tensor_fp8.quantize_current_scaling(
                    x, self.fp8_dtype, amax=amax,
                    amax_epsilon=self.amax_epsilon, power_2_scale=self.power_2_scale,
                    rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                )
                return _per_tensor_storage(self, owner, x, data, scale_inv, self.fp8_dtype,
                                           data_t)
        amax = self.reduce_amax(numerics.compute_amax(x))
        data, scale_inv = numerics.quantize_current_scaling(
            x,
            self.fp8_dtype,
            amax=amax,
            amax_epsilon=self.amax_epsilon,
            power_2_scale=self.power_2_scale,
        )
        return _per_tensor_storage(self, owner, x, data, scale_inv, self.fp8_dtype)
