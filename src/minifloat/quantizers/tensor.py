"""QuantizedTensor: a torch.Tensor wrapper subclass over any QuantizedStorage.

Its nominal dtype is the high-precision dtype, so modules and optimizers see an ordinary
parameter. `__torch_dispatch__` handles a small explicit table of ops on the quantized bytes
(detach, clone, copy_, device moves, reshapes that keep the last dim); every other op dequantizes
its quantized arguments and runs in high precision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from .base import QuantizedStorage

aten = torch.ops.aten
_INNER_PREFIX = "_q_"


def as_storage(x: torch.Tensor | QuantizedStorage) -> QuantizedStorage:
    """The storage behind a QuantizedTensor (a bare storage is returned as is)."""
    if isinstance(x, QuantizedTensor):
        return x._storage
    if isinstance(x, QuantizedStorage):
        return x
    raise TypeError(f"expected a QuantizedTensor or QuantizedStorage, got {type(x).__name__}")


_TENSOR_CLASSES: dict[type[QuantizedStorage], type[QuantizedTensor]] = {}


def register_tensor_class(storage_class: type[QuantizedStorage], tensor_class: type) -> None:
    """Make QuantizedTensor(storage) build `tensor_class` for storages of `storage_class` (a
    subclass adding that family's accessors, e.g. HybridQuantizedTensor)."""
    _TENSOR_CLASSES[storage_class] = tensor_class


def _rebuild_quantized_tensor(storage: QuantizedStorage, requires_grad: bool) -> QuantizedTensor:
    """Unpickling entry point (registered as a torch.serialization safe global)."""
    return QuantizedTensor(storage, requires_grad=requires_grad)


class QuantizedTensor(torch.Tensor):
    """A quantized tensor that behaves like its high-precision self wherever it is not special."""

    _storage: QuantizedStorage

    @staticmethod
    def __new__(cls, storage: QuantizedStorage, requires_grad: bool = False) -> QuantizedTensor:
        if cls is QuantizedTensor:
            cls = _TENSOR_CLASSES.get(type(storage), cls)
        instance = torch.Tensor._make_wrapper_subclass(
            cls,
            storage.shape,
            dtype=storage.dtype,
            device=storage.device,
            requires_grad=requires_grad,
        )
        instance._storage = storage
        return instance

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- tracing (torch.compile): the buffers are the inner tensors ----

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        """The present buffers, as `_q_<field>` attributes, and what rebuilds the storage.

        Why: dynamo and AOTAutograd take a weight built by quantized_model_init or gathered by
        FSDP2's low-precision all-gather as these inner tensors; the GEMM ops then receive the
        buffers (modules/quantized_weight_ops.py). The context ends in the storage's quantizer,
        which __metadata_guard__ leaves out: every layer's weight has a quantizer object of its
        own, and a guard on it would recompile per layer."""
        storage = self._storage
        if not storage.tensor_fields():
            raise NotImplementedError(
                f"{type(storage).__name__} weights (a format per direction) do not run under "
                "torch.compile yet; build the model in high precision (or, under FSDP2, gather "
                "high-precision weights) to compile it, or run eagerly")
        present = storage.present_fields()
        return [_INNER_PREFIX + name for name in present], (
            type(storage), storage.shape, storage.dtype, storage.metadata_values(), present,
            storage.quantizer)

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict, context: tuple, outer_size, outer_stride
                             ) -> QuantizedTensor:
        storage_class, shape, dtype, metadata, present, quantizer = context
        buffers = {name: inner_tensors[_INNER_PREFIX + name] for name in present}
        return QuantizedTensor(storage_class.from_buffers(shape, dtype, metadata, buffers,
                                                          quantizer))

    @classmethod
    def __metadata_guard__(cls, expected: tuple, actual: tuple) -> bool:
        return expected[:-1] == actual[:-1]  # all but the quantizer (see __tensor_flatten__)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(_INNER_PREFIX):  # __tensor_flatten__'s names for the buffers
            return getattr(self._storage, name[len(_INNER_PREFIX):])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ---- the storage's API, reachable from the tensor ----

    @property
    def quantized_storage(self) -> QuantizedStorage:
        return self._storage

    @property
    def quantizer(self):
        return self._storage.quantizer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._storage.dequantize(dtype)

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        self._storage.update_usage(rowwise=rowwise, columnwise=columnwise)

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedStorage]:
        return self._storage.prepare_for_saving()

    @property
    def data(self) -> torch.Tensor:
        """A detached alias sharing the quantized buffers (as torch's .data is)."""
        return _detach(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """`param.data = t` requantizes t into this tensor's buffers, every copy it holds (a
        quantized t of the same format is copied byte for byte)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"QuantizedTensor.data must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(
                f"cannot assign .data of shape {tuple(value.shape)} to a QuantizedTensor of "
                f"shape {tuple(self.shape)}; a quantized parameter keeps its shape"
            )
        with torch.no_grad():
            _copy_(self, value)

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return self._storage.restore_from_saved(tensors)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"QuantizedTensor({self._storage!r}, values={self.dequantize()})"

    def __reduce_ex__(self, protocol: int):
        return _rebuild_quantized_tensor, (self._storage, self.requires_grad)

    # ---- dispatch ----

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result

        decoded: dict[int, torch.Tensor] = {}

        def unwrap(value):
            if isinstance(value, QuantizedTensor):
                decoded[id(value)] = value.dequantize()
                return decoded[id(value)]
            return value

        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if not func.overloadpacket.__name__.endswith("_"):
            return result
        # An in-place op (an optimizer step, plain or _foreach_): it mutated the decoded copies;
        # requantize each quantized target from its copy so the update is not lost.
        targets = args[0] if isinstance(args[0], list | tuple) else [args[0]]
        for target in targets:
            if isinstance(target, QuantizedTensor):
                _copy_(target, decoded[id(target)])
        return args[0] if isinstance(result, torch.Tensor) else result


def _detach(tensor: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(tensor._storage.detach())


def _clone(tensor: QuantizedTensor, memory_format=None) -> QuantizedTensor:
    return QuantizedTensor(tensor._storage.clone())


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if not isinstance(dst, QuantizedTensor):
        dst.copy_(src.dequantize(dst.dtype), non_blocking=non_blocking)
        return dst
    if isinstance(src, QuantizedTensor) and dst._storage.same_format(src._storage):
        dst._storage.copy_from(src._storage)
        return dst
    source = src.dequantize() if isinstance(src, QuantizedTensor) else src
    quantizer = dst._storage.quantizer
    if quantizer is None:
        raise RuntimeError("cannot copy into a QuantizedTensor that has no quantizer")
    quantizer.update_quantized(source.expand(dst.shape), dst)
    return dst


def _to_copy(tensor: QuantizedTensor, *, dtype=None, device=None, **kwargs) -> torch.Tensor:
    if dtype is not None and dtype != tensor.dtype:
        return tensor.dequantize(dtype).to(device=device) if device else tensor.dequantize(dtype)
    if device is None or torch.device(device) == tensor.device:
        return QuantizedTensor(tensor._storage.clone())
    return QuantizedTensor(tensor._storage.to_device(device))


def _view(tensor: QuantizedTensor, shape) -> torch.Tensor:
    """Reshape over the [M, K] buffers: exact (a metadata change) when the last dim is kept."""
    new_shape = _infer_shape(list(shape), tensor.numel())
    if len(new_shape) == 0 or new_shape[-1] != tensor.shape[-1]:
        return NotImplemented  # would mix rows and blocks: fall back to high precision
    return QuantizedTensor(tensor._storage.with_shape(tuple(new_shape)))


def _as_strided(tensor: QuantizedTensor, size, stride, storage_offset=None) -> torch.Tensor:
    """The identity view (FSDP2 takes one of every unsharded parameter) keeps the quantized
    buffers; any other strided view falls back to high precision."""
    contiguous = torch.empty(tuple(size), device="meta").stride()
    if (tuple(size) == tuple(tensor.shape) and tuple(stride) == contiguous
            and not storage_offset):
        return _detach(tensor)
    return NotImplemented


def _infer_shape(shape: list[int], numel: int) -> list[int]:
    if -1 in shape:
        known = 1
        for size in shape:
            if size != -1:
                known *= size
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def register_handler(op, handler) -> None:
    """Let QuantizedTensor arguments of `op` run through `handler(*args, **kwargs)` instead of
    being dequantized (the GEMM ops hand a quantized weight's buffers to their own variants)."""
    _HANDLERS[op] = handler


_HANDLERS = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.clone.default: _clone,
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.as_strided.default: _as_strided,
}
