"""FP8 current scaling under torch.compile with the casts and GEMMs in the traced graph: by
default wherever inductor compiles without CUDA graphs (MINIFLOAT_GRAPH_CASTS=1 always, =0
never).

Why: without CUDA graphs (FSDP2's compiled blocks, the default compile mode) the compiled step
is host-bound, and the lean path's GEMM ops spend their host time in Python (the ops'
dispatch, the plans, the launches): at 1b under FSDP2 on one H200, 145 ms a step against 125
with the GEMMs and the casts in the graph, which inductor's wrapper launches directly; 3-29%
faster in each of four FSDP2 runs (BENCHMARKS.md, twentieth session). Under CUDA graphs
(reduce-overhead) no Python runs a step, and the ops path's GPU work is 1.9% less, so it stays
there: compiled_without_cuda_graphs reads the mode from the backend dynamo traces for.

What runs: `GraphCastGemm`, an autograd.Function dynamo traces through, makes the GEMMs with
gemm_paths.scaled_mm_bytes (the same torch._scaled_mm call as every other path) and the casts:
- a tensor that needs both copies (an input whose columnwise copy backward keeps, a gradient
  for dgrad and wgrad, a weight) through the `minifloat::current_cast` op: the one-launch
  Triton cast, one read for both copies. Inductor's own code made the transposed copy in a
  second kernel that recomputed the producer (1287 against 1032 kernels a 1b step, 78.4
  against 72.7 ms under CUDA graphs: the same bytes read twice, at about half the copy
  bandwidth). A GEMM input or gradient hands the op max|x| from the graph, which inductor fuses
  into the producer (as the lean path does); a weight, a leaf, lets the kernel take its own;
- a tensor that needs one copy (the input under `save_original_input`, and backward's recast
  of it) in torch ops (input_recast.per_tensor_cast: clamp, one rounding conversion, the scale
  by the per_tensor_scales op), which inductor fuses into the producer: the bf16 tensor is
  never written.
The bytes and results are those of the lean path and of eager
(tests/compile/test_graph_casts.py).

Serves what the compiled lean path serves with current scaling on every cast: a stateless plan
of one GEMM, high-precision weights, amax_epsilon 0, and lean_fp8.shapes_apply. Under tensor
parallelism the operands split across the TP group's ranks have their maxima all-reduced in
the graph (functional collectives; the ops path reduces inside its op), so each rank casts its
shard with the whole tensor's scale, as eager does.
`save_original_input` keeps the input instead of its columnwise copy,
`rebuild_weight_copy_in_backward` the weight instead of its copy; backward casts them again
(the input with forward's amax). Everything else takes gemm_op's ops.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch._dynamo.symbolic_convert import InstructionTranslator

from ..gemm_paths import scaled_mm_bytes
from . import lean_fp8
from .input_recast import fp8_dtype_of, per_tensor_cast, tensor_maximum
from .op_define import define_op


def _from_environment() -> bool | None:
    value = os.environ.get("MINIFLOAT_GRAPH_CASTS", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"MINIFLOAT_GRAPH_CASTS={value!r}: set it to 1 (the casts in the traced "
                         "graph always), 0 (never), or leave it unset (wherever inductor "
                         "compiles without CUDA graphs)")
    return {"1": True, "0": False}.get(value)


# True: always, False: never, None (the default): wherever inductor compiles without CUDA graphs
ENABLED: bool | None = _from_environment()


@contextlib.contextmanager
def switched(on: bool | None = True) -> Iterator[None]:
    """ENABLED set to `on` inside, restored after (benchmarks compare both paths in one
    process). Dynamo guards on ENABLED, so a compiled function traced with one value is traced
    again when called with the other."""
    global ENABLED
    before, ENABLED = ENABLED, on
    try:
        yield
    finally:
        ENABLED = before


def wanted() -> bool:
    """Whether the function being traced takes this path: ENABLED where it is set, else
    whether its compile runs without CUDA graphs (compiled_without_cuda_graphs)."""
    return ENABLED if ENABLED is not None else compiled_without_cuda_graphs()


# torch.compile's backend object for inductor (a private class: absent, nothing matches it)
_INDUCTOR_WRAPPER = getattr(torch, "_TorchCompileInductorWrapper", type(None))


@torch._dynamo.assume_constant_result
def compiled_without_cuda_graphs() -> bool:
    """Whether the compile that is tracing the caller is inductor's without CUDA graphs (the
    default mode and FSDP2's compiled blocks: host-bound, where this path is faster), read
    from the backend dynamo was given: torch.compile's inductor wrapper keeps its mode's
    settings in `config` (reduce-overhead: {"triton.cudagraphs": True}), else inductor's
    global setting counts. Any other backend, or a torch whose tracer does not show it: False,
    and gemm_op's ops serve (their casts win under CUDA graphs, BENCHMARKS.md twentieth
    session). A constant to dynamo: no guard, and each compile asks again."""
    try:
        backend = InstructionTranslator.current_tx().output.compiler_fn
    except (AttributeError, RuntimeError, AssertionError):
        return False
    for _ in range(8):  # debug wrappers around the backend
        config = getattr(backend, "config", None)
        if isinstance(backend, _INDUCTOR_WRAPPER) and isinstance(config, dict):
            inductor = sys.modules.get("torch._inductor.config")
            default = bool(inductor and inductor.triton.cudagraphs)
            return not config.get("triton.cudagraphs", default)
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "compiler_fn", None)
        if backend is None:
            return False
    return False


# the spec's bits: the plan applies; E5M2 (else E4M3) and power-of-2 scales per cast
APPLIES = 1
_E5M2 = {"input": 2, "weight": 4, "grad_output": 8}
_POW2 = {"input": 16, "weight": 32, "grad_output": 64}


def spec_of(plan: lean_fp8.LeanPlan | None) -> int:
    """The plan's casts as an int (dynamo takes it as a constant; no quantizer reaches a
    guard), or 0 where this path does not serve them."""
    if plan is None:
        return 0
    spec = APPLIES
    for role in ("input", "weight", "grad_output"):
        cast = getattr(plan, role)
        if cast.scale is not None or cast.amax_epsilon != 0.0:  # delayed scaling, epsilon
            return 0
        spec |= (_E5M2[role] if cast.fp8_dtype == torch.float8_e5m2 else 0)
        spec |= (_POW2[role] if cast.power_2_scale else 0)
    return spec


def applies(spec: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call takes this path (trace-time facts only: constants, shapes, types)."""
    if not spec & APPLIES or type(weight) not in (torch.nn.Parameter, torch.Tensor):
        return False
    n, k = weight.shape
    return (x.dim() > 0 and x.dtype == weight.dtype and x.is_contiguous()
            and lean_fp8.shapes_apply(x.device.type, x.dtype, x.numel() // k if k else 0, k, n))


REDUCED = {"input": 1, "weight": 2, "grad_output": 4}  # GraphCastGemm's reduce_mask bits


def reduce_mask_of(slots: frozenset[str]) -> int:
    """The operands whose maxima a tensor-parallel layer all-reduces, as GraphCastGemm's mask."""
    return sum(REDUCED[slot] for slot in slots)


def _maximum(x2d: torch.Tensor, role: str, reduce_mask: int, group) -> torch.Tensor:
    """max|x2d|, all-reduced (MAX) over the tensor-parallel group where `role` is split across
    its ranks: a functional collective, which the traced graph holds (eagerly it waits on use).
    Every rank then casts its shard with the full tensor's scale, as eager's quantizer copies
    holding the group do (Quantizer.reduce_amax)."""
    amax = tensor_maximum(x2d)
    if reduce_mask & REDUCED[role]:
        amax = funcol.wait_tensor(funcol.all_reduce(amax, "max", group))
    return amax


def _cast(spec: int, role: str, x2d: torch.Tensor, *, rowwise: bool, columnwise: bool,
          amax: torch.Tensor | None = None):
    """(data or None, data_t or None, scale_inv) of a GEMM input or gradient. Both copies: the
    Triton cast (the `minifloat::current_cast` op, handed max|x| from the graph, which inductor
    fuses into x's producer); one copy: torch ops that inductor fuses into x's producer."""
    e5m2, power_2_scale = bool(spec & _E5M2[role]), bool(spec & _POW2[role])
    if rowwise and columnwise:
        amax = tensor_maximum(x2d) if amax is None else amax
        data, data_t, scale_inv = _current_cast(x2d, [amax.reshape(1)], e5m2, power_2_scale,
                                                True, True)
        return data, data_t, scale_inv
    return per_tensor_cast(x2d, fp8_dtype_of(e5m2), 0.0, power_2_scale, rowwise=rowwise,
                           columnwise=columnwise, amax=amax)


def current_cast_impl(x2d: torch.Tensor, amax: list[torch.Tensor], e5m2: bool,
                      power_2_scale: bool, rowwise: bool, columnwise: bool
                      ) -> list[torch.Tensor]:
    """[data (if rowwise), data_t (if columnwise), scale_inv]: a tensor's current-scaling
    copies, as lean_fp8.Cast makes them: the one-launch kernel where the kernels run, with
    max|x2d| taken by the kernel (`amax` empty: a weight) or given (`amax` [max|x2d|])."""
    data, data_t, scale_inv = lean_fp8.Cast(fp8_dtype_of(e5m2), 0.0, power_2_scale)(
        x2d.detach(), rowwise=rowwise, columnwise=columnwise, amax=amax[0] if amax else None)
    return [t for t in (data, data_t) if t is not None] + [scale_inv.reshape(1)]


def _current_cast_fake(x2d, amax, e5m2, power_2_scale, rowwise, columnwise):
    m, k = x2d.shape
    dtype = fp8_dtype_of(e5m2)
    return ([x2d.new_empty((m, k), dtype=dtype)] if rowwise else []) + (
        [x2d.new_empty((k, m), dtype=dtype)] if columnwise else []) + [
        x2d.new_empty((1,), dtype=torch.float32)]


_current_cast = define_op("current_cast", current_cast_impl, _current_cast_fake)


def _weight_copies(spec: int, weight: torch.Tensor, *, rowwise: bool, columnwise: bool,
                   reduce_mask: int = 0, group=None):
    """(data or None, data_t or None, scale_inv) of the weight, through the op (which takes
    the weight's maximum itself, unless a tensor-parallel group reduces it first)."""
    amax = ([_maximum(weight, "weight", reduce_mask, group).reshape(1)]
            if reduce_mask & REDUCED["weight"] else [])
    outputs = iter(_current_cast(weight, amax, bool(spec & _E5M2["weight"]),
                                 bool(spec & _POW2["weight"]), rowwise, columnwise))
    data = next(outputs) if rowwise else None
    data_t = next(outputs) if columnwise else None
    return data, data_t, next(outputs)


class GraphCastGemm(torch.autograd.Function):
    """y = x W^T + b with per-tensor FP8 current scaling, casts and GEMMs in torch ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                spec: int, need_dgrad: bool, need_wgrad: bool, rebuild: bool,
                save_original: bool, reduce_mask: int = 0, group=None) -> torch.Tensor:
        """`reduce_mask` (REDUCED bits) names the operands a tensor-parallel layer splits
        across `group`'s ranks; their maxima are all-reduced before the casts."""
        n, k = weight.shape
        x2d = x.reshape(-1, k)
        keep_input_copy = need_wgrad and not save_original
        keep_weight_copy = need_dgrad and not rebuild
        x_amax = _maximum(x2d, "input", reduce_mask, group)
        x_data, x_t, x_scale_inv = _cast(spec, "input", x2d, rowwise=True,
                                         columnwise=keep_input_copy, amax=x_amax)
        w_data, w_t, w_scale_inv = _weight_copies(spec, weight, rowwise=True,
                                                  columnwise=keep_weight_copy,
                                                  reduce_mask=reduce_mask, group=group)
        y = scaled_mm_bytes(x_data, w_data, x_scale_inv, w_scale_inv, out_dtype=x.dtype,
                            bias=bias, fast_accumulation=True)
        # what backward reads: the copies, or (memory options) the input and its maximum, the
        # weight itself
        input_kept = ((x_t, x_scale_inv) if keep_input_copy
                      else (x2d, x_amax) if need_wgrad else ())
        weight_kept = ((w_t, w_scale_inv) if keep_weight_copy
                       else (weight,) if need_dgrad else ())
        ctx.save_for_backward(*input_kept, *weight_kept)
        ctx.counts = (len(input_kept), len(weight_kept))
        ctx.flags = (spec, need_dgrad, need_wgrad, keep_input_copy, keep_weight_copy,
                     bias is not None)
        ctx.x_shape = x.shape
        ctx.reduction = (reduce_mask, group)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        spec, need_dgrad, need_wgrad, keep_input_copy, keep_weight_copy, has_bias = ctx.flags
        saved = ctx.saved_tensors
        input_kept, weight_kept = saved[:ctx.counts[0]], saved[ctx.counts[0]:]
        # row-major, as torch._scaled_mm takes its first operand (a no-op when it is already)
        dy2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_bias = dy2d.sum(dim=0) if has_bias else None  # as the other paths sum it
        grad_x = grad_weight = None
        reduce_mask, group = ctx.reduction
        if need_dgrad or need_wgrad:
            dy_amax = (_maximum(dy2d, "grad_output", reduce_mask, group)
                       if reduce_mask & REDUCED["grad_output"] else None)
            dy_data, dy_t, dy_scale_inv = _cast(spec, "grad_output", dy2d, rowwise=need_dgrad,
                                                columnwise=need_wgrad, amax=dy_amax)
        if need_dgrad:
            if keep_weight_copy:
                w_t, w_scale_inv = weight_kept
            else:  # the copy forward would have kept: the same weight, the same bytes
                _, w_t, w_scale_inv = _weight_copies(spec, weight_kept[0], rowwise=False,
                                                     columnwise=True, reduce_mask=reduce_mask,
                                                     group=group)
            grad_x = scaled_mm_bytes(dy_data, w_t, dy_scale_inv, w_scale_inv,
                                     out_dtype=grad_output.dtype, bias=None,
                                     fast_accumulation=False).reshape(ctx.x_shape)
        if need_wgrad:
            if keep_input_copy:
                x_t, x_scale_inv = input_kept
            else:  # the copy forward would have kept, cast from the transposed input: the
                #      same bytes, an expression the joint graph cannot merge with forward's
                #      rowwise cast (the partitioner would then keep that one-byte copy
                #      instead of recomputing the input where it is free to)
                x2d, x_amax = input_kept
                x_t, _, x_scale_inv = _cast(spec, "input", x2d.t(), rowwise=True,
                                            columnwise=False, amax=x_amax)
                x_t = x_t.contiguous()
            grad_weight = scaled_mm_bytes(dy_t, x_t, dy_scale_inv, x_scale_inv,
                                          out_dtype=grad_output.dtype, bias=None,
                                          fast_accumulation=False)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None
