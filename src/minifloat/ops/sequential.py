"""ops.Sequential: runs fusible ops inside one autograd function (the operation fuser).

Per call the fuser
1. plans: which gradients each op needs (from torch.is_grad_enabled() and requires_grad of the
   input and of every parameter before the op, as the unfused graph would have them), which
   Bias ops fold into the GEMM before them, and the quantizers neighbours hand along;
2. notes every GEMM op's delayed-scaling states in the autocast round and, inside
   minifloat.checkpoint, records (or, in the recompute, puts back) their scales in op order
   before any op runs (an op quantizes its output with the
   next op's quantizer, which must already see the scales of that op's call);
3. forward: op i gets `next_input_quantizer` = op i+1's input quantizer when op i+1 is a GEMM op
   that accepts quantized inputs, and `prev_grad_output_quantizer` = op i-1's grad_output
   quantizer likewise (kept for backward); every tensor an op saves goes through this
   function's ctx.save_for_backward;
4. backward: `fuser_backward` in reverse order, collecting each op's parameter gradients.

Extra per-call inputs: `Sequential.forward(x, m_splits=None)` hands m_splits to every op that
lists "m_splits" in its `extra_inputs` (the GroupedLinear op).

Roles: at construction a GEMM op's output slot takes op i+1's input role and its grad_input
slot op i-1's grad_output role, when that neighbour declares one (GEMM ops); next to a
high-precision op, or at either end, the module default stays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..autocast import get_autocast_state
from ..modules.linear_function import graph_kept
from .base import FusibleOperation, OperationContext, QuantizedActivation
from .bias import Bias
from .gemm_base import GemmOperation


@dataclass
class _FusedCall:
    """Everything one call of the fuser needs besides the tensors."""

    ops: list[FusibleOperation]
    contexts: list[OperationContext]
    param_counts: list[int]
    extra: list[dict]
    next_input_quantizers: list = field(default_factory=list)
    prev_grad_output_quantizers: list = field(default_factory=list)
    saved_counts: list[int] = field(default_factory=list)


class _OperationFuser(torch.autograd.Function):
    """y = op_{n-1}(... op_0(x)); params = every op's parameters, op by op."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, call: _FusedCall, *params: torch.Tensor) -> torch.Tensor:
        for i, (op, op_ctx) in enumerate(zip(call.ops, call.contexts, strict=True)):
            x = op.fuser_forward(
                op_ctx, x,
                next_input_quantizer=call.next_input_quantizers[i],
                prev_grad_output_quantizer=call.prev_grad_output_quantizers[i],
                **call.extra[i],
            )
        if isinstance(x, QuantizedActivation):  # the last op has no consumer to hand on to
            raise RuntimeError("the last op of a Sequential returned a quantized tensor")
        saved = []
        for op_ctx in call.contexts:
            saved.extend(op_ctx.to_save)
            call.saved_counts.append(len(op_ctx.to_save))
            op_ctx.to_save = ()
        ctx.save_for_backward(*saved)
        ctx.call = call
        return x

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        call = ctx.call
        saved = ctx.saved_tensors
        start = 0
        for op_ctx, count in zip(call.contexts, call.saved_counts, strict=True):
            op_ctx.saved_tensors = tuple(saved[start:start + count])
            start += count
        grads: list[list[torch.Tensor | None]] = [[] for _ in call.ops]
        dy = grad_output
        for i in reversed(range(len(call.ops))):
            op, op_ctx = call.ops[i], call.contexts[i]
            if not op_ctx.needs_backward:  # nothing before it needs a gradient either
                grads[i] = [None] * call.param_counts[i]
                dy = None
                continue
            dy, grads[i] = op.fuser_backward(op_ctx, dy)
            if len(grads[i]) != call.param_counts[i]:
                raise RuntimeError(f"{type(op).__name__}.fuser_backward returned "
                                   f"{len(grads[i])} gradients for {call.param_counts[i]} "
                                   "parameters")
        if not graph_kept():
            # the op contexts live as long as the graph object (often into the next step):
            # drop their views of the saved tensors, as autograd drops its own
            for op_ctx in call.contexts:
                op_ctx.saved_tensors = ()
        if isinstance(dy, QuantizedActivation):
            raise RuntimeError("the first op of a Sequential returned a quantized grad_input")
        return (dy, None, *[g for op_grads in grads for g in op_grads])


class Sequential(nn.Module):
    """Fusible ops run as one autograd function; see the module docstring.

    Nested Sequentials are flattened. An op may appear once (its per-call state and its
    delayed-scaling enrolment are per position).
    """

    def __init__(self, *ops: FusibleOperation) -> None:
        super().__init__()
        flat: list[FusibleOperation] = []
        for op in ops:
            flat.extend(op if isinstance(op, Sequential) else [op])
        for op in flat:
            if not isinstance(op, FusibleOperation):
                raise TypeError(f"ops.Sequential takes fusible ops (minifloat.ops.*), got "
                                f"{type(op).__name__}")
        if len({id(op) for op in flat}) != len(flat):
            raise ValueError("an op appears twice in ops.Sequential; give each position its "
                             "own op (share parameters instead)")
        for index, op in enumerate(flat):
            self.add_module(str(index), op)
        self._label_consumer_roles()

    def _ops(self) -> list[FusibleOperation]:
        return list(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[FusibleOperation]:
        return iter(self._ops())

    def __getitem__(self, index: int) -> FusibleOperation:
        return self._ops()[index]

    def _label_consumer_roles(self) -> None:
        """Output slot of op i: op i+1's input role; grad_input slot: op i-1's grad_output."""
        ops = self._ops()
        for i, op in enumerate(ops):
            if not isinstance(op, GemmOperation):
                continue
            output = ops[i + 1].input_role() if i + 1 < len(ops) else None
            grad_input = ops[i - 1].grad_output_role() if i > 0 else None
            if output is not None or grad_input is not None:
                op.set_consumer_roles(output=output, grad_input=grad_input)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | None = None,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Run the ops as one autograd function; `is_first_microbatch` as in TransformerEngine
        (None: weights quantized afresh; True: quantized and kept; False: kept copies reused)."""
        ops = self._ops()
        if not ops:
            return x
        extra_values = {"m_splits": m_splits}
        extra = [{name: extra_values[name] for name in op.extra_inputs} for op in ops]
        if m_splits is not None and not any("m_splits" in e for e in extra):
            raise ValueError("m_splits was given but no op of this Sequential takes it")
        call = self._plan(x, ops, extra)
        for op_ctx in call.contexts:
            op_ctx.is_first_microbatch = is_first_microbatch
        params = [p for op in ops for p in op.parameters()]
        with contextlib.ExitStack() as stack:
            for op, op_ctx in zip(ops, call.contexts, strict=True):
                if isinstance(op, GemmOperation) and op_ctx.recipe is not None:
                    stack.enter_context(op.delayed_scaling_scope(op_ctx.recipe))
            return _OperationFuser.apply(x, call, *params)

    def _plan(self, x: torch.Tensor, ops: list[FusibleOperation], extra: list[dict]
              ) -> _FusedCall:
        state = get_autocast_state()
        recipe = state.recipe if state.enabled else None
        grad_enabled = torch.is_grad_enabled()
        contexts, counts = [], []
        upstream_requires_grad = x.requires_grad
        for op in ops:
            params = list(op.parameters())
            contexts.append(OperationContext(
                recipe=recipe,
                grad_enabled=grad_enabled,
                input_requires_grad=grad_enabled and upstream_requires_grad,
                param_requires_grad=[grad_enabled and p.requires_grad for p in params],
            ))
            counts.append(len(params))
            upstream_requires_grad = upstream_requires_grad or any(p.requires_grad
                                                                   for p in params)
        for i in range(len(ops) - 1):
            op, following = ops[i], ops[i + 1]
            if (isinstance(op, GemmOperation) and op.takes_epilogue_bias
                    and isinstance(following, Bias)):
                contexts[i].epilogue_bias = following.bias
                contexts[i + 1].bias_applied = True
        for op, op_ctx in zip(ops, contexts, strict=True):
            op.fuser_prepare(op_ctx)
        producers_in = [op.input_quantizer_for_producer(c) for op, c in zip(ops, contexts,
                                                                             strict=True)]
        producers_grad = [op.grad_output_quantizer_for_producer(c)
                          for op, c in zip(ops, contexts, strict=True)]
        return _FusedCall(
            ops=ops,
            contexts=contexts,
            param_counts=counts,
            extra=extra,
            next_input_quantizers=producers_in[1:] + [None],
            prev_grad_output_quantizers=[None] + producers_grad[:-1],
        )
