"""What every fusible operation shares: the per-call context, the hand-off of quantized tensors
between neighbours, and the base class of the high-precision (non-GEMM) operations.

An operation never runs alone: `ops.Sequential` runs a list of them inside one autograd
function (see sequential.py). Forward calls `fuser_forward(ctx, x, next_input_quantizer=...,
prev_grad_output_quantizer=...)` on each op in order; backward calls `fuser_backward(ctx, dy)`
in reverse. `ctx` is the op's own OperationContext for this call: the fuser fills in what it
planned (recipe, which gradients are needed), the op keeps what its backward needs.

Hand-off. When op i+1 is a GEMM op, the fuser gives op i that op's input quantizer, configured
with the copies op i+1 needs (rowwise for fprop, columnwise for wgrad); op i quantizes its
output with it and passes a QuantizedActivation on, which op i+1 uses as is. Likewise in
backward: an op whose previous op is a GEMM op quantizes its grad_input with that op's
grad_output quantizer. Quantization is a deterministic function of the high-precision tensor
and the quantizer's state, and the hand-off runs it at the same point of the sequence of
quantize calls as the consumer would, so results are bit for bit those of the unfused modules
(stochastic rounding included: the random draws happen in the same order). This holds for
every producer, GEMM or not (a GELU, Bias or norm computes its output or grad_input in high
precision first, then quantizes exactly that tensor). No hand-off happens into the
GroupedLinear op (its per-expert quantizers need the splits: it quantizes its own operands),
for empty tensors, or outside autocast; the tensor then goes on in high precision and the
consumer quantizes it itself, with the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..quantizers import QuantizedStorage, Quantizer
from ..recipes import QuantizerRole, Recipe


@dataclass
class QuantizedActivation:
    """A tensor handed to a GEMM op already quantized: the storage over the [M, K] view and the
    logical shape of the high-precision tensor it stands for."""

    storage: QuantizedStorage
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


def hand_on(
    x: torch.Tensor, quantizer: Quantizer | None
) -> torch.Tensor | QuantizedActivation:
    """Quantize `x` for the neighbour that owns `quantizer` (configured by that neighbour);
    without a quantizer, or for an empty tensor (the consumer's empty-split path handles it),
    x goes on in high precision."""
    if quantizer is None or x.numel() == 0:
        return x
    storage = quantizer(x.reshape(-1, x.shape[-1]))
    return QuantizedActivation(storage, x.shape)


def high_precision(x: torch.Tensor | QuantizedActivation, who: str) -> torch.Tensor:
    """Non-GEMM ops compute in high precision; the fuser never hands them a quantized tensor."""
    if isinstance(x, QuantizedActivation):
        raise TypeError(f"{who} computes in high precision but was handed a quantized tensor; "
                        "only GEMM ops accept quantized inputs")
    return x


class OperationContext:
    """One op's state for one call: the fuser's plan plus what the op keeps for backward.

    `save_for_backward` collects tensors the fuser passes through the autograd function's own
    ctx.save_for_backward (so saved-tensor hooks, CPU offload and minifloat.checkpoint see them);
    in backward they come back as `saved_tensors`.
    """

    def __init__(
        self,
        *,
        recipe: Recipe | None,
        grad_enabled: bool,
        input_requires_grad: bool,
        param_requires_grad: Sequence[bool],
    ) -> None:
        self.recipe = recipe  # None outside autocast: everything in high precision
        self.grad_enabled = grad_enabled
        self.input_requires_grad = input_requires_grad
        self.param_requires_grad = list(param_requires_grad)
        self.prev_grad_output_quantizer: Quantizer | None = None
        self.epilogue_bias: torch.Tensor | None = None  # a following Bias, added in the GEMM
        self.bias_applied = False  # this Bias op was added by the previous GEMM op
        # TransformerEngine's is_first_microbatch for weight quantization (modules/weights.py):
        # None quantizes afresh, True quantizes and keeps, False reuses the kept copy
        self.is_first_microbatch: bool | None = None
        self.to_save: tuple[torch.Tensor | None, ...] = ()
        self.saved_tensors: tuple[torch.Tensor | None, ...] = ()

    @property
    def needs_backward(self) -> bool:
        return self.input_requires_grad or any(self.param_requires_grad)

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self.to_save = tuple(tensors)


class FusibleOperation(nn.Module):
    """Base of every op. Non-GEMM ops declare no quantizer roles and compute in high precision;
    GEMM ops (gemm_base.GemmOperation) are QuantizedModules with the linear slot layout."""

    # names of Sequential.forward keyword inputs this op takes (e.g. "m_splits")
    extra_inputs: ClassVar[tuple[str, ...]] = ()

    def get_quantizer_roles(self, forward: bool) -> list[QuantizerRole]:
        return []

    def input_role(self) -> QuantizerRole | None:
        """The role under which this op quantizes its input (None: consumed in high precision)."""
        return None

    def grad_output_role(self) -> QuantizerRole | None:
        """The role under which this op quantizes its grad_output (None: high precision)."""
        return None

    def fuser_prepare(self, ctx: OperationContext) -> None:
        """Called by the fuser for every op before any op runs (GEMM ops pick quantizers)."""

    def input_quantizer_for_producer(self, ctx: OperationContext) -> Quantizer | None:
        """The quantizer the previous op should quantize its output with (GEMM ops)."""
        return None

    def grad_output_quantizer_for_producer(self, ctx: OperationContext) -> Quantizer | None:
        """The quantizer the next op should quantize its grad_input with (GEMM ops)."""
        return None

    def fuser_forward(
        self,
        ctx: OperationContext,
        x: torch.Tensor | QuantizedActivation,
        *,
        next_input_quantizer: Quantizer | None,
        prev_grad_output_quantizer: Quantizer | None,
        **extra,
    ) -> torch.Tensor | QuantizedActivation:
        raise NotImplementedError

    def fuser_backward(
        self, ctx: OperationContext, dy: torch.Tensor | QuantizedActivation
    ) -> tuple[torch.Tensor | QuantizedActivation | None, list[torch.Tensor | None]]:
        """(grad_input, gradients of list(self.parameters()) in that order)."""
        raise NotImplementedError


class HighPrecisionOperation(FusibleOperation):
    """A non-GEMM op given by one torch function of its input and its parameters.

    Forward runs `compute` (no autograd inside the fuser) and saves the input; backward runs
    `compute` again under enable_grad on the saved input and takes torch.autograd.grad, so every
    gradient is what the torch module computes, bit for bit, at the cost of recomputing a cheap
    elementwise or normalization function.
    """

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fuser_forward(self, ctx, x, *, next_input_quantizer, prev_grad_output_quantizer,
                      **extra):
        x = high_precision(x, type(self).__name__)
        ctx.prev_grad_output_quantizer = prev_grad_output_quantizer
        ctx.save_for_backward(x)
        return hand_on(self.compute(x), next_input_quantizer)

    def fuser_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        dy = high_precision(dy, type(self).__name__)
        params = list(self.parameters())
        wanted = [p for p, needed in zip(params, ctx.param_requires_grad, strict=True) if needed]
        with torch.enable_grad():
            x_leaf = x.detach().requires_grad_(ctx.input_requires_grad)
            inputs = ([x_leaf] if ctx.input_requires_grad else []) + wanted
            grads = list(torch.autograd.grad(self.compute(x_leaf), inputs, dy))
        dx = grads.pop(0) if ctx.input_requires_grad else None
        param_grads = [grads.pop(0) if needed else None for needed in ctx.param_requires_grad]
        if dx is not None:
            dx = hand_on(dx, ctx.prev_grad_output_quantizer)
        return dx, param_grads
