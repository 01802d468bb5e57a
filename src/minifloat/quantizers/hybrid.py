"""Hybrid (per-direction) quantization: one format for the rowwise copy, another for the columnwise.

The two copies of a tensor feed different GEMMs (DESIGN.md §3): X rowwise feeds fprop and X
columnwise feeds wgrad; W rowwise feeds fprop and W columnwise dgrad; dY rowwise feeds dgrad and
dY columnwise wgrad. A HybridQuantizer owns two ordinary quantizers, each pinned to one direction,
so that e.g. the forward runs MXFP8 while the backward runs NVFP4 without a recipe per
combination (seed 000). The HybridStorage holds one sub-storage per direction, and general_gemm
asks it for the copy the GEMM needs.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from .base import QuantizedStorage, Quantizer
from .tensor import QuantizedTensor, register_tensor_class

_DIRECTIONS = ("rowwise", "columnwise")


class HybridStorage(QuantizedStorage):
    """A rowwise sub-storage (one format) and a columnwise sub-storage (maybe another format).

    Each sub-storage holds only its own direction's copy and keeps the logical shape [.., K] of
    the whole tensor. Either may be None (that usage was not requested or was dropped).
    """

    format_name: ClassVar[str] = "hybrid"

    def __init__(
        self,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        quantizer: Quantizer | None = None,
        rowwise_storage: QuantizedStorage | None = None,
        columnwise_storage: QuantizedStorage | None = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.quantizer = quantizer
        self.rowwise_storage = rowwise_storage
        self.columnwise_storage = columnwise_storage
        for direction, sub in zip(_DIRECTIONS, self._subs(), strict=True):
            if sub is not None and sub.shape != self.shape:
                raise ValueError(
                    f"HybridStorage: the {direction} sub-storage has shape {tuple(sub.shape)}, "
                    f"the hybrid tensor {tuple(self.shape)}; both must keep the logical shape"
                )

    def _subs(self) -> tuple[QuantizedStorage | None, QuantizedStorage | None]:
        return self.rowwise_storage, self.columnwise_storage

    # ---- structure ----

    def has_rowwise(self) -> bool:
        return self.rowwise_storage is not None

    def has_columnwise(self) -> bool:
        return self.columnwise_storage is not None

    @property
    def device(self) -> torch.device:
        for sub in self._subs():
            if sub is not None:
                return sub.device
        raise RuntimeError("HybridStorage holds no data: both copies were released")

    def direction_storage(self, columnwise: bool) -> QuantizedStorage:
        sub = self.columnwise_storage if columnwise else self.rowwise_storage
        if sub is None:
            direction = "columnwise" if columnwise else "rowwise"
            raise ValueError(
                f"{self!r} lacks the {direction} copy; quantize with {direction} usage or call "
                "update_usage"
            )
        return sub

    def with_shape(self, shape: tuple[int, ...]) -> HybridStorage:
        return self._map_subs(lambda sub: sub.with_shape(shape), shape)

    def _map_subs(self, transform, shape: tuple[int, ...] | None = None) -> HybridStorage:
        """A new HybridStorage whose present sub-storages are `transform(sub)`."""
        row, col = (None if sub is None else transform(sub) for sub in self._subs())
        return HybridStorage(shape=self.shape if shape is None else shape, dtype=self.dtype,
                             quantizer=self.quantizer,
                             rowwise_storage=row, columnwise_storage=col)

    # ---- values ----

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """High-precision values; the rowwise copy is preferred (it is never transformed)."""
        dtype = self.dtype if dtype is None else dtype
        for sub in self._subs():
            if sub is not None:
                return sub.dequantize(dtype).reshape(self.shape)
        raise RuntimeError("cannot dequantize HybridStorage: it holds no data")

    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.direction_storage(columnwise).gemm_operand(columnwise)

    # ---- directions ----

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Drop a copy, or derive a missing one from the other where that is exact.

        A copy can be derived only when both directions use the same format (the children are
        configured alike) and that format derives one direction from the other exactly
        (NUMERICS.md §9: per-tensor FP8, 2D blocks, identity). Otherwise the error says to
        requantize from high precision.
        """
        want_row = self.has_rowwise() if rowwise is None else rowwise
        want_col = self.has_columnwise() if columnwise is None else columnwise
        if not (want_row or want_col):
            raise ValueError(
                "update_usage would drop both the rowwise and the columnwise copy; keep one, or "
                "release the tensor itself"
            )
        if want_row and not self.has_rowwise():
            self.rowwise_storage = self._derive(columnwise=False)
        if want_col and not self.has_columnwise():
            self.columnwise_storage = self._derive(columnwise=True)
        if not want_row:
            self.rowwise_storage = None
        if not want_col:
            self.columnwise_storage = None

    def _derive(self, columnwise: bool) -> QuantizedStorage:
        source = self.rowwise_storage if columnwise else self.columnwise_storage
        target = "columnwise" if columnwise else "rowwise"
        hybrid = self.quantizer
        if not (isinstance(hybrid, HybridQuantizer) and hybrid.directions_share_format()):
            raise ValueError(
                f"hybrid tensor: the {target} copy cannot be derived from the other copy, whose "
                f"format differs ({source.format_name} vs the {target} child's); quantize again "
                f"from high precision with {target} usage enabled"
            )
        derived = source.detach()
        derived.update_usage(rowwise=not columnwise, columnwise=columnwise)
        return derived

    # ---- autograd saving, copies, devices ----

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedStorage]:
        tensors: list[torch.Tensor | None] = []
        for sub in self._subs():
            if sub is not None:
                tensors.extend(sub.prepare_for_saving()[0])
        return tensors, self

    def restore_from_saved(
        self, tensors: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        rest = list(tensors)
        for sub in self._subs():
            if sub is not None:
                rest = sub.restore_from_saved(rest)
        return rest

    def clone(self) -> HybridStorage:
        return self._map_subs(lambda sub: sub.clone())

    def detach(self) -> HybridStorage:
        return self._map_subs(lambda sub: sub.detach())

    def to_device(self, device: torch.device | str) -> HybridStorage:
        return self._map_subs(lambda sub: sub.to_device(device))

    def same_format(self, other: QuantizedStorage) -> bool:
        if type(other) is not HybridStorage or other.shape != self.shape:
            return False
        for mine, theirs in zip(self._subs(), other._subs(), strict=True):
            if (mine is None) != (theirs is None):
                return False
            if mine is not None and not mine.same_format(theirs):
                return False
        return True

    def copy_from(self, other: QuantizedStorage) -> None:
        """Copy both sub-storages' bytes in place (same formats and copies required)."""
        if not self.same_format(other):
            raise ValueError(
                f"cannot copy {other!r} bytes into {self!r}: the formats or copies differ; "
                "requantize from high precision"
            )
        for mine, theirs in zip(self._subs(), other._subs(), strict=True):
            if mine is not None:
                mine.copy_from(theirs)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["shape"] = tuple(self.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["shape"] = torch.Size(state["shape"])
        self.__dict__.update(state)

    def __repr__(self) -> str:
        def describe(sub):
            return "none" if sub is None else sub.format_name

        return (f"HybridStorage(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"rowwise={describe(self.rowwise_storage)}, "
                f"columnwise={describe(self.columnwise_storage)})")


class HybridQuantizedTensor(QuantizedTensor):
    """A QuantizedTensor over a HybridStorage (made automatically for hybrid storages)."""

    @property
    def rowwise_storage(self) -> QuantizedStorage | None:
        return self._storage.rowwise_storage

    @property
    def columnwise_storage(self) -> QuantizedStorage | None:
        return self._storage.columnwise_storage

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"HybridQuantizedTensor({self._storage!r}, values={self.dequantize()})"


register_tensor_class(HybridStorage, HybridQuantizedTensor)


class HybridQuantizer(Quantizer):
    """Quantize the rowwise copy with one quantizer and the columnwise copy with another.

    The children are distinct objects (the same object passed twice is copied), each pinned to
    its direction and set to return bare storages: the hybrid takes ownership of the quantizers
    it is given and configures them. Only the requested usages are quantized: with
    rowwise usage only, the columnwise child is never called. An amax reduction group set on the
    hybrid for a call is handed to each child that quantizes in that call.
    """

    storage_class = HybridStorage

    def __init__(
        self,
        rowwise_quantizer: Quantizer,
        columnwise_quantizer: Quantizer,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        for direction, child in zip(_DIRECTIONS, (rowwise_quantizer, columnwise_quantizer),
                                    strict=True):
            if not isinstance(child, Quantizer):
                raise TypeError(
                    f"HybridQuantizer {direction}_quantizer must be a minifloat Quantizer, got "
                    f"{type(child).__name__}; use IdentityQuantizer() for high precision"
                )
            if isinstance(child, HybridQuantizer):
                raise TypeError(
                    f"HybridQuantizer {direction}_quantizer is itself hybrid; give the "
                    "quantizer of that one direction instead"
                )
        if columnwise_quantizer is rowwise_quantizer:
            columnwise_quantizer = columnwise_quantizer.copy()
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        self.rowwise_quantizer = rowwise_quantizer
        self.columnwise_quantizer = columnwise_quantizer
        self._pin_children()

    def _pin_children(self) -> None:
        for child in (self.rowwise_quantizer, self.columnwise_quantizer):
            child.internal = True
        self.rowwise_quantizer.set_usage(rowwise=self.rowwise_usage, columnwise=False)
        self.columnwise_quantizer.set_usage(rowwise=False, columnwise=self.columnwise_usage)

    # ---- configuration ----

    def set_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Set the usages and forward each to the child of that direction."""
        super().set_usage(rowwise=rowwise, columnwise=columnwise)
        self._pin_children()

    def copy(self) -> HybridQuantizer:
        """A copy with copied children, so reconfiguring it leaves this one alone (delayed-
        scaling children still share their state tensors, as Quantizer.copy does)."""
        clone = super().copy()
        clone.rowwise_quantizer = self.rowwise_quantizer.copy()
        clone.columnwise_quantizer = self.columnwise_quantizer.copy()
        return clone

    def _children_in_use(self) -> list[Quantizer]:
        children = []
        if self.rowwise_usage:
            children.append(self.rowwise_quantizer)
        if self.columnwise_usage:
            children.append(self.columnwise_quantizer)
        return children

    def check_shape(self, shape: tuple[int, ...]) -> None:
        super().check_shape(shape)
        for child in self._children_in_use():
            child.check_shape(shape)

    def row_multiple(self) -> int:
        return math.lcm(self.rowwise_quantizer.row_multiple(),
                        self.columnwise_quantizer.row_multiple())

    def fast_gemm_row_multiple(self) -> int:
        return math.lcm(self.rowwise_quantizer.fast_gemm_row_multiple(),
                        self.columnwise_quantizer.fast_gemm_row_multiple())

    def state_version(self) -> int:
        return hash((self.rowwise_quantizer.state_version(),
                     self.columnwise_quantizer.state_version()))

    def is_requantization_safe(self) -> bool:
        return (self.rowwise_quantizer.is_requantization_safe()
                and self.columnwise_quantizer.is_requantization_safe())

    def directions_share_format(self) -> bool:
        """Whether both children would write the same bytes for a tensor (same family and
        configuration), so one direction's copy may be derived from the other's."""
        return (self.rowwise_quantizer.format_signature()
                == self.columnwise_quantizer.format_signature())

    # ---- quantization ----

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> HybridStorage:
        subs: dict[str, QuantizedStorage | None] = {}
        for direction, child, in_use in (
            ("rowwise", self.rowwise_quantizer, self.rowwise_usage),
            ("columnwise", self.columnwise_quantizer, self.columnwise_usage),
        ):
            subs[direction] = (self._quantize_child(child, x, direction == "rowwise")
                               if in_use else None)
        return HybridStorage(
            shape=x.shape,
            dtype=x.dtype,
            quantizer=owner,
            rowwise_storage=subs["rowwise"],
            columnwise_storage=subs["columnwise"],
        )

    def _quantize_child(self, child: Quantizer, x: torch.Tensor, rowwise: bool
                        ) -> QuantizedStorage:
        """One direction's sub-storage: the child pinned to that direction, internal, with this
        call's reduction group, quantizing x (already checked and detached by quantize()).

        A child already in exactly that state (the usual case: _pin_children set it, and no
        group is set) quantizes as it is; otherwise a throwaway copy carries the pinning and
        the group, so that a child object shared with another hybrid, or re-pinned there, is
        left alone. The output records a stripped copy either way, as quantize() would."""
        group = self.amax_reduction_group
        if not (child.rowwise_usage is rowwise and child.columnwise_usage is (not rowwise)
                and child.internal is True and child.amax_reduction_group is group):
            child = child.copy()
            child.amax_reduction_group = group
            child.internal = True
            child.set_usage(rowwise=rowwise, columnwise=not rowwise)
        if type(child).quantize is not Quantizer.quantize:  # a child with its own entry point
            return child.quantize(x)
        return child._quantize_impl(x, child._output_quantizer())

    def __repr__(self) -> str:
        return (f"HybridQuantizer(rowwise={self.rowwise_quantizer!r}, "
                f"columnwise={self.columnwise_quantizer!r}, usages=({self.rowwise_usage}, "
                f"{self.columnwise_usage}))")
