"""Quantizer (the builder) and QuantizedStorage (the data holder), common to every format.

A storage holds the buffers of one format in two groups, rowwise and columnwise, plus the
nominal (high-precision) dtype and logical shape. Buffers are 2D over the [M, K] view of the
tensor, so reshapes that keep the last dim are free. The generic machinery here (usage updates,
saving for backward, clone, device moves, pickling) works from the buffer names each family
declares, so a family only writes what is specific to its format: quantize, dequantize and the
derivation of one direction from the other.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.distributed as dist

_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)
_HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TENSOR_CLASS: list[type] = []  # QuantizedTensor, imported on first use (tensor.py imports us)


_KERNEL_MODULES: dict[str, ModuleType] = {}


def kernel_module(name: str) -> ModuleType:
    """minifloat.kernels.<name>, imported on the first fast-path call and kept.

    Why: the kernel modules import Triton, so the quantizers import them only once a CUDA tensor
    (or the interpreter) asks for a kernel; an import statement at that point ran on every
    quantize call (about half a microsecond of host time each), a dict lookup does not."""
    module = _KERNEL_MODULES.get(name)
    if module is None:
        module = importlib.import_module(f"minifloat.kernels.{name}")
        _KERNEL_MODULES[name] = module
    return module


def _tensor_class() -> type:
    """QuantizedTensor, without an import statement per quantize call."""
    if not _TENSOR_CLASS:
        from .tensor import QuantizedTensor

        _TENSOR_CLASS.append(QuantizedTensor)
    return _TENSOR_CLASS[0]


class QuantizedStorage:
    """Buffers of one quantized tensor, without the torch.Tensor wrapper.

    Subclasses declare `rowwise_fields` and `columnwise_fields` (names of tensor attributes;
    None when absent; the first name of each is the data), `shared_fields` (tensors both copies
    use) and `metadata_fields` (plain values kept by clone/pickle), and implement
    `_dequantize_impl`, optionally `_derive_rowwise` / `_derive_columnwise`.
    """

    rowwise_fields: ClassVar[tuple[str, ...]] = ()
    columnwise_fields: ClassVar[tuple[str, ...]] = ()
    shared_fields: ClassVar[tuple[str, ...]] = ()  # tensors both copies use (never dropped)
    metadata_fields: ClassVar[tuple[str, ...]] = ()
    format_name: ClassVar[str] = "quantized"
    _tensor_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the field tuple every constructor, copy and save walks: built once per class
        cls._tensor_fields = cls.rowwise_fields + cls.columnwise_fields + cls.shared_fields

    def __init__(
        self,
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        quantizer: Quantizer | None = None,
        **fields: Any,
    ) -> None:
        # written into __dict__ directly: one storage per quantize call, on the host's hot path
        state = self.__dict__
        state["shape"] = shape if type(shape) is torch.Size else torch.Size(shape)
        state["dtype"] = dtype
        state["quantizer"] = quantizer
        pop = fields.pop
        for name in self._tensor_fields:
            state[name] = pop(name, None)
        for name in self.metadata_fields:
            state[name] = pop(name)
        if fields:
            raise TypeError(f"{type(self).__name__} got unknown fields {sorted(fields)}")

    # ---- structure ----

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        return cls._tensor_fields

    def present_fields(self) -> tuple[str, ...]:
        """The names of the buffers this storage holds now (tensor_fields that are not None)."""
        return tuple(name for name in self._tensor_fields if getattr(self, name) is not None)

    def metadata_values(self) -> tuple:
        """The metadata_fields' values, in their order (what from_buffers takes back)."""
        return tuple(getattr(self, name) for name in self.metadata_fields)

    @classmethod
    def from_buffers(cls, shape: tuple[int, ...], dtype: torch.dtype, metadata: tuple,
                     buffers: dict[str, torch.Tensor],
                     quantizer: Quantizer | None = None) -> QuantizedStorage:
        """A storage of this class over `buffers` (by field name; absent fields None) with the
        metadata_values() of the storage it stands for: how a storage taken apart into its
        buffers (QuantizedTensor.__tensor_flatten__, the compiled GEMM ops' weight layouts) is
        put back together."""
        fields = dict(zip(cls.metadata_fields, metadata, strict=True))
        fields.update(buffers)
        return cls(shape=torch.Size(shape), dtype=dtype, quantizer=quantizer, **fields)

    def has_rowwise(self) -> bool:
        return getattr(self, self.rowwise_fields[0]) is not None

    def has_columnwise(self) -> bool:
        return getattr(self, self.columnwise_fields[0]) is not None

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    @property
    def device(self) -> torch.device:
        for name in self.tensor_fields():
            buffer = getattr(self, name)
            if buffer is not None:
                return buffer.device
        raise RuntimeError(f"{type(self).__name__} holds no data: every buffer was released")

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """[M, K] of the 2D view this storage's buffers are laid out over."""
        k = self.shape[-1] if len(self.shape) else 1
        m = self.shape.numel() // k if k else 0
        return m, k

    def _replace(self, transform) -> QuantizedStorage:
        """A new storage of the same class with every present buffer mapped through `transform`.

        Built without the keyword constructor (detach runs per GEMM operand on the hot path);
        a subclass with its own __init__ goes through it."""
        cls = type(self)
        source = self.__dict__
        if cls.__init__ is not QuantizedStorage.__init__:
            fields = {name: source[name] for name in cls.metadata_fields}
            for name in cls._tensor_fields:
                buffer = source[name]
                fields[name] = None if buffer is None else transform(buffer)
            return cls(shape=self.shape, dtype=self.dtype, quantizer=self.quantizer, **fields)
        new = object.__new__(cls)
        state = new.__dict__
        state["shape"] = source["shape"]
        state["dtype"] = source["dtype"]
        state["quantizer"] = source["quantizer"]
        for name in cls._tensor_fields:
            buffer = source[name]
            state[name] = None if buffer is None else transform(buffer)
        for name in cls.metadata_fields:
            state[name] = source[name]
        return new

    # ---- values ----

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """High-precision values in the logical shape (rowwise copy preferred)."""
        dtype = self.dtype if dtype is None else dtype
        if not (self.has_rowwise() or self.has_columnwise()):
            raise RuntimeError(f"cannot dequantize {type(self).__name__}: it holds no data")
        return self._dequantize_impl(dtype).reshape(self.shape)

    def _dequantize_impl(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def direction_storage(self, columnwise: bool) -> QuantizedStorage:
        """The storage that holds the copy of one direction: this one (a hybrid storage answers
        with the sub-storage of that direction, whose format may differ)."""
        return self

    def gemm_operand(self, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values, alpha) of one copy for an emulated GEMM: fp32 values with the reduction dim
        last (the rowwise copy gives x [M, K], the columnwise copy x^T [K, M]), exactly as the
        format decodes them, and an optional per-tensor factor applied after accumulation."""
        raise NotImplementedError

    # ---- directions ----

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Keep, drop or derive each copy; None leaves a direction as it is.

        Dropping is always allowed (but not of the last copy). A missing copy is derived where the
        format allows it exactly (NUMERICS.md §9) and raises a clear error otherwise.
        """
        want_row = self.has_rowwise() if rowwise is None else rowwise
        want_col = self.has_columnwise() if columnwise is None else columnwise
        if not (want_row or want_col):
            raise ValueError(
                "update_usage would drop both the rowwise and the columnwise copy; keep one, or "
                "release the tensor itself"
            )
        if want_row and not self.has_rowwise():
            self._derive_rowwise()
        if want_col and not self.has_columnwise():
            self._derive_columnwise()
        if not want_row:
            self._drop(self.rowwise_fields)
        if not want_col:
            self._drop(self.columnwise_fields)

    def _drop(self, names: tuple[str, ...]) -> None:
        for name in names:
            setattr(self, name, None)

    def _derive_rowwise(self) -> None:
        raise ValueError(
            f"{self.format_name}: the rowwise copy cannot be derived from the columnwise one "
            "(NUMERICS.md §9); quantize again from high precision with rowwise usage enabled"
        )

    def _derive_columnwise(self) -> None:
        raise ValueError(
            f"{self.format_name}: the columnwise copy cannot be derived from the rowwise one "
            "(NUMERICS.md §9); quantize again from high precision with columnwise usage enabled"
        )

    # ---- autograd saving, copies, devices ----

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedStorage]:
        """Hand the buffers to ctx.save_for_backward; this object keeps only metadata."""
        tensors = [getattr(self, name) for name in self.tensor_fields()]
        self._drop(self.tensor_fields())
        return tensors, self

    def restore_from_saved(
        self, tensors: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Take back the buffers from saved tensors; returns the tensors left over."""
        names = self.tensor_fields()
        for name, tensor in zip(names, tensors, strict=False):
            setattr(self, name, tensor)
        return list(tensors[len(names):])

    def clone(self) -> QuantizedStorage:
        return self._replace(lambda t: t.clone())

    def detach(self) -> QuantizedStorage:
        """A new storage object sharing the same buffers."""
        return self._replace(lambda t: t.detach())

    def with_shape(self, shape: tuple[int, ...]) -> QuantizedStorage:
        """A storage sharing these buffers under another logical shape with the same last dim
        (the buffers are laid out over [M, K], so this is exact)."""
        storage = self.detach()
        storage.shape = torch.Size(shape)
        return storage

    def to_device(self, device: torch.device | str) -> QuantizedStorage:
        return self._replace(lambda t: t.to(device))

    def same_format(self, other: QuantizedStorage) -> bool:
        """Same class, shape and metadata (element dtype, 1D/2D, RHT): bytes copy over as is."""
        return (
            type(other) is type(self)
            and other.shape == self.shape
            and all(getattr(self, n) == getattr(other, n) for n in self.metadata_fields)
        )

    def copy_from(self, other: QuantizedStorage) -> None:
        """Copy buffers of a storage of the same format and shape into this one's, in place."""
        if not self.same_format(other):
            raise ValueError(
                f"cannot copy {other!r} bytes into {self!r}: the formats differ; requantize "
                "from high precision"
            )
        for name in self.tensor_fields():
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None:
                mine.copy_(theirs)
            elif mine is not None:
                raise ValueError(
                    f"cannot copy into {type(self).__name__}: the source lacks {name}; call "
                    "update_usage on the source first"
                )
        for name in self.metadata_fields:
            setattr(self, name, getattr(other, name))

    def __getstate__(self) -> dict[str, Any]:
        """Pickle state. FP8 buffers travel as uint8 views: plain pickle of float8 tensors fails
        in torch (its legacy storage loader has no float8 path), torch.save handles both."""
        state = dict(self.__dict__)
        state["shape"] = tuple(self.shape)
        fp8_fields = {}
        for name in self.tensor_fields():
            buffer = state[name]
            if buffer is not None and buffer.dtype in _FLOAT8_DTYPES:
                fp8_fields[name] = buffer.dtype
                state[name] = buffer.view(torch.uint8)
        state["_fp8_fields"] = fp8_fields
        if self.has_rowwise() and self.has_columnwise() and self.derives_columnwise():
            # a checkpoint holds the bytes once: the transposed copy is rebuilt on load, the
            # same bytes (NUMERICS.md §9), so a quantized weight saves at 1 byte per element
            for name in self.columnwise_fields:
                state[name] = None
                fp8_fields.pop(name, None)
            state["_derive_columnwise_on_load"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["shape"] = torch.Size(state["shape"])
        for name, dtype in state.pop("_fp8_fields", {}).items():
            state[name] = state[name].view(dtype)
        derive = state.pop("_derive_columnwise_on_load", False)
        self.__dict__.update(state)
        if derive:
            self._derive_columnwise()

    def derives_columnwise(self) -> bool:
        """Whether the format's columnwise copy is exactly a rearrangement of the rowwise one
        (NUMERICS.md §9): pickling then leaves it out, and distributed casts write only the
        rowwise bytes and rebuild it after the all-gather."""
        return False

    def __repr__(self) -> str:
        directions = [d for d, ok in (("rowwise", self.has_rowwise()),
                                      ("columnwise", self.has_columnwise())) if ok]
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"copies={'+'.join(directions) or 'none'})")


class Quantizer:
    """Builds quantized tensors of one format for one tensor slot.

    Holds plain values only (dtypes, bools, numbers; tensors for delayed-scaling state) so that it
    pickles and can be a torch.compile constant. An amax reduction group may be set for the next
    quantize call at the point of use (see DESIGN.md §5); it is never pickled or copied into
    outputs.
    """

    storage_class: ClassVar[type[QuantizedStorage]]

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True, internal: bool = False):
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = internal
        self.amax_reduction_group = None

    # ---- configuration ----

    def set_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def copy(self) -> Quantizer:
        """A shallow copy: same configuration; shared delayed-scaling state tensors."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)  # not copy.copy: __getstate__ strips the group
        return clone

    def is_quantizable(self, x: torch.Tensor) -> bool:
        """Whether x's shape fits this format's block constraints (no error raised)."""
        try:
            self.check_shape(tuple(x.shape))
        except ValueError:
            return False
        return True

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise a clear ValueError when this format cannot hold a tensor of `shape`."""
        if len(shape) == 0:
            raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")

    def row_multiple(self) -> int:
        """The multiple the rows M of the 2D view [M, K] must be of (blocks that run along M:
        MXFP8 32, NVFP4 16); 1 where any M fits. Modules pad activations' rows to it."""
        return 1

    def fast_gemm_row_multiple(self) -> int:
        """The multiple of rows that this format's CUDA GEMM needs beyond row_multiple (torch's
        scaled_mm: every dim a multiple of 16, blockwise 128; the rows become wgrad's reduction
        dim). Modules on CUDA pad activations' rows to it, exactly (zero rows), because a
        GEMM that misses it is decoded and emulated, many times slower. 1: no such GEMM."""
        return 1

    def state_version(self) -> int:
        """Changes whenever state that affects the bytes changes (delayed-scaling scales), so
        caches of quantized weights know to requantize. Stateless quantizers return 0."""
        return 0

    def is_requantization_safe(self) -> bool:
        """Whether quantizing the same values twice gives the same bytes (False with SR)."""
        return True

    def format_signature(self) -> tuple:
        """Everything that decides the bytes this quantizer writes, usages aside: two quantizers
        with equal signatures produce identical storages for the same input. State tensors
        (delayed scaling) count by identity of their memory, not by value."""

        def describe(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                # the storage object, not data_ptr(): fake tensors (torch.compile) have no
                # address, and views or aliases of one buffer share the storage either way
                return ("tensor", value.device, value.untyped_storage()._cdata,
                        value.storage_offset(),
                        tuple(value.shape), value.dtype)
            if isinstance(value, Quantizer):
                return value.format_signature()
            return value

        skip = ("rowwise_usage", "columnwise_usage", "internal", "amax_reduction_group")
        return (type(self).__qualname__,) + tuple(
            (name, describe(value)) for name, value in sorted(self.__dict__.items())
            if name not in skip
        )

    # ---- quantization ----

    def quantize(self, x: torch.Tensor) -> torch.Tensor | QuantizedStorage:
        """Quantize the usages this quantizer asks for; a QuantizedTensor unless `internal`."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"quantize expects a float32, bfloat16 or float16 tensor, got {x.dtype}; "
                "dequantize or cast it first"
            )
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(
                f"{type(self).__name__} has neither rowwise nor columnwise usage; call "
                "set_usage(rowwise=True) or set_usage(columnwise=True) first"
            )
        self.check_shape(x.shape)  # a torch.Size is a tuple of ints
        return self._wrap(self._quantize_impl(x.detach(), self._output_quantizer()))

    __call__ = quantize

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer) -> QuantizedStorage:
        raise NotImplementedError

    def _output_quantizer(self) -> Quantizer:
        """The quantizer recorded on outputs: a copy with the reduction group stripped."""
        owner = self.copy()
        owner.amax_reduction_group = None
        return owner

    def _wrap(self, storage: QuantizedStorage) -> torch.Tensor | QuantizedStorage:
        return storage if self.internal else _tensor_class()(storage)

    def reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """All-reduce (MAX) an amax over this call's reduction group, when one is set."""
        group = self.amax_reduction_group
        if group is None:
            return amax
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    def make_empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | QuantizedStorage:
        """An uninitialised quantized tensor of `shape` with this quantizer's usages."""
        self.check_shape(tuple(shape))
        placeholder = torch.zeros(shape, dtype=dtype, device=device)
        return self._wrap(self._quantize_impl(placeholder, self._output_quantizer()))

    def update_quantized(
        self, src: torch.Tensor, dst: torch.Tensor | QuantizedStorage
    ) -> torch.Tensor | QuantizedStorage:
        """Requantize high-precision `src` into `dst`'s buffers in place; returns dst."""
        from .tensor import as_storage

        target = as_storage(dst)
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(
                f"update_quantized: source shape {tuple(src.shape)} differs from the destination "
                f"shape {tuple(target.shape)}"
            )
        quantizer = self.copy()
        quantizer.set_usage(rowwise=target.has_rowwise(), columnwise=target.has_columnwise())
        fresh = quantizer._quantize_impl(src.detach().to(target.device), self._output_quantizer())
        target.copy_from(fresh)
        return dst

    def __getstate__(self) -> dict[str, Any]:
        """Pickle plain configuration only; never a process group."""
        state = dict(self.__dict__)
        state["amax_reduction_group"] = None
        return state

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rowwise={self.rowwise_usage}, "
                f"columnwise={self.columnwise_usage}, internal={self.internal})")
