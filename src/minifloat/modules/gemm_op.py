"""The GEMMs of a quantized module as two torch ops, for torch.compile (fullgraph).

Eagerly, a module call runs the autograd function LinearGemms (linear_function.py), which holds
quantizers and quantized storages on its ctx: plain Python objects that dynamo cannot put in a
graph. Under torch.compile the same forward and backward (`gemms_forward` / `gemms_backward`,
shared with LinearGemms, so both paths compute the same bytes) run inside two ops,
`minifloat::gemms_forward` and `minifloat::gemms_backward` (defined through torch.library, not
custom_op: op_define.py says why), whose arguments are tensors and plain constants only:

- `plan`: an int standing for the module's quantizer configuration (gemm_plans.py), the same
  for every module of equal configuration (every block of a model under one recipe), so that
  compiling the blocks one by one adds no guard that differs from block to block and nothing
  recompiles;
- `state`: the tensors the quantizers read and record into (delayed scaling's scale and amax
  history), the module's own, so each module's amaxes land in its own history;
- shapes, splits, GEMM slots and flags as ints and bools.

One FP8 current-scaling GEMM runs inside the ops as kernel calls only (lean_ops.py); quantized
weights (QuantizedTensor parameters) reach the ops' twins as their buffers
(quantized_weight_ops.py). The Triton kernels run inside the ops and inductor schedules around
them. The fake (meta)
implementation is the op itself run on fake tensors: the quantizers then take the pure-torch
reference path (kernels.available is False for fake tensors), which lays out the same buffers.

Backward needs the metadata of the storages its saved buffers belong to (format, element dtype,
which buffers are present). It is a pure function of the op's constant arguments, so the
backward op recomputes it once per configuration by running the forward on fake tensors
(`_layout`), instead of carrying Python objects across the graph. Plan ids are hashes of the
configuration, so they mean the same in every process (compiled-graph caches on disk hold them).

The state tensors are recorded into in place by both ops without being declared as mutated:
nothing else in a graph reads them (the delayed-scaling update runs at autocast entry and exit,
outside), and declaring them would let functionalization hand the ops copies, losing the
amaxes recorded in backward.

Memory options (modules/memory.py): with `rebuild` the forward op keeps no weight copy and the
backward op quantizes the weights again; with `save_original` it keeps no input copy and the
autograd formula (`_backward`) makes it in torch ops before calling the backward op
(input_recast.py says why there). Under delayed scaling the forward op returns forward's scales
after the kept buffers (`carried_counts`): autocast updates the state's before backward runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..autocast import note_delayed_use
from ..compile_cache import tag_compile_caches
from ..kernels import is_fake
from ..quantizers import QuantizedStorage, QuantizedTensor, Quantizer
from ..recipe_state import RecipeState
from . import graph_casts, lean_ops
from .gemm_plans import (
    PLANS,
    carried_counts,
    gemm_call,
    quantizer_without_tensors,
    rebuild_applies,
    save_original_applies,
    slot_quantizers,
)
from .input_recast import input_copy_buffers
from .linear_function import (
    SavedForBackward,
    WeightInfo,
    gemms_backward,
    gemms_forward,
    rebuild_weight_copy,
)
from .op_define import define_op
from .tp_reduction import reduces_split_maxima, reduction_key

tag_compile_caches()  # the backward formula below is not in inductor's cache keys otherwise


@dataclass
class GemmBinding:
    """What a module needs to run under one recipe, resolved once per recipe (not per call)."""

    forward_quantizers: list[Quantizer]
    backward_quantizers: list[Quantizer]
    plan: int
    state: list[torch.Tensor]
    delayed_pair: object  # autocast's registration of the delayed-scaling states, or None
    recipe_states: tuple[RecipeState, RecipeState]
    lean_plans: list  # per GEMM: lean_fp8.LeanPlan, or None (the general path)
    # per GEMM: the multiple its input's (and output gradient's) rows must be of (1: any),
    # and on CUDA, where the formats' fast GEMMs need more (Quantizer.fast_gemm_row_multiple)
    row_multiples: list[int] = field(default_factory=list)
    cuda_row_multiples: list[int] = field(default_factory=list)

    def rows_multiple(self, gemm: int, x: torch.Tensor) -> int:
        """What GEMM `gemm`'s rows are padded to for an input `x`."""
        return (self.cuda_row_multiples if on_fast_gemm_device(x) else self.row_multiples)[gemm]


def on_fast_gemm_device(x: torch.Tensor) -> bool:
    """Whether x's GEMMs may take the CUDA fast paths (a function, so CPU tests can say yes)."""
    return x.device.type == "cuda"


# data_ptr of a module's first state tensor -> its delayed-scaling registration (weakly): the
# forward op notes the states it ran with in autocast's round, as the eager path does
_DELAYED_BY_STATE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def detached_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory with a version counter of its own. The ops record amaxes
    in place and autocast rescales in place between forward and backward; through aliases
    neither write bumps the version that autograd checks on what the graph saved."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape,
                      tensor.stride())


def note_compiled_delayed_use(state: list[torch.Tensor], pair: object) -> None:
    """Let the compiled forward find the delayed-scaling registration of these state tensors."""
    _DELAYED_BY_STATE[state[0].data_ptr()] = pair
_LAYOUTS: dict[tuple, tuple[SavedForBackward, list[bool]]] = {}


def _with_biases(biases: list[torch.Tensor], has_bias: list[bool]) -> list[torch.Tensor | None]:
    present = iter(biases)
    return [next(present) if flag else None for flag in has_bias]


def _unaliased(tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Custom-op outputs may alias neither inputs nor each other: clone those that would (a
    high-precision passthrough copy that is the input itself, say, or two experts' copies that
    a multi-tensor kernel wrote into one buffer). Memory is compared by storage (fake tensors
    have storages too), not by `_base`: a tensor made over another's storage has no base."""
    seen = {_storage_key(t) for t in inputs}
    result = []
    for tensor in tensors:
        key = _storage_key(tensor)
        if key in seen:
            tensor = tensor.clone()
            key = _storage_key(tensor)
        seen.add(key)
        result.append(tensor)
    return result


def present_buffers(weight: QuantizedTensor) -> list[torch.Tensor]:
    """A quantized weight's present buffers, in present_fields order (the order its layout and
    QuantizedTensor.__tensor_flatten__ give them)."""
    storage = weight.quantized_storage
    return [getattr(storage, name) for name in storage.present_fields()]


def _buffers(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, each QuantizedTensor (a quantized weight) as its present buffers."""
    result = []
    for tensor in tensors:
        if isinstance(tensor, QuantizedTensor):
            result.extend(present_buffers(tensor))
        else:
            result.append(tensor)
    return result


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def gemms_forward_impl(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
    has_bias: list[bool], state: list[torch.Tensor], plan: int, gemms: list[int],
    m_splits: list[int], need_dgrad: bool, need_wgrad: bool, rebuild: bool, save_original: bool,
    input_amax: list[torch.Tensor], reduction: str,
) -> list[torch.Tensor]:
    """[y, the buffers backward keeps (present ones, in order), delayed scales carried]; with
    `rebuild` no weight copy is kept, with `save_original` no input copy (backward quantizes
    them again; the autograd context keeps the weights and the input themselves, and under
    delayed scaling the forward scales: carried_counts). `input_amax`: [max|x|] where the
    traced graph computed it for the lean path's cast (lean_ops.compiled_amax), else [].
    `reduction` (reduction_key): a TP group's split operands, quantized with their maxima
    reduced over it (the collective runs inside the op, as eager runs it; not on fake
    tensors, whose shapes it does not change)."""
    if is_fake(x):
        reduction = ""
    if not state and not is_fake(x) and not reduction:  # one FP8 current-scaling GEMM
        lean = lean_ops.lean_plan(plan, gemms, PLANS[plan].stateless)
        if lean is not None and lean_ops.forward_applies(x, weights):
            # save_original: no input copy kept; _backward makes it (input_recast.py)
            y, *kept = lean_ops.lean_forward(x, weights[0], biases[0] if has_bias[0] else None,
                                             lean, need_dgrad, need_wgrad and not save_original,
                                             rebuild, input_amax[0] if input_amax else None)
            return [y.contiguous()] + _unaliased(kept, [x, *_buffers(weights), *biases])
    if state and not is_fake(x):
        pair = _DELAYED_BY_STATE.get(state[0].data_ptr())
        if pair is not None:
            note_delayed_use(pair)
        state = [detached_alias(t) for t in state]
    call = gemm_call(plan, state, gemms, m_splits, need_dgrad, need_wgrad, rebuild,
                      save_original, reduction)
    weight_scales, input_scales = carried_counts(plan, gemms, need_dgrad, need_wgrad, rebuild,
                                                  save_original)
    # forward's delayed-scaling scales, copied before autocast's exit updates the state
    carried = [q.scale.clone() for q in call.weight_quantizers[:weight_scales]]
    if input_scales:
        scale = call.input_quantizers[0].scale.clone()
        carried += [scale, torch.reciprocal(scale)]  # the reference's scale_inv
    y, _, saved = gemms_forward(x, call, weights, _with_biases(biases, has_bias))
    # contiguous: the kernels write row-major buffers where the reference path (which the fake
    # implementation runs) may hand over a transposed view; inductor asserts the fake strides
    kept = [t.contiguous() for t in saved.tensors if t is not None]
    return [y.contiguous()] + _unaliased(kept, [x, *_buffers(weights), *biases]) + carried


# the op on fake tensors is its own fake implementation (the reference path lays out the
# same buffers as the kernels)
_gemms_forward_op = define_op("gemms_forward", gemms_forward_impl)


def _layout(plan: int, gemms: list[int], m_splits: list[int], x_shape: list[int],
            weight_shapes: list[int], has_bias: list[bool], need_dgrad: bool, need_wgrad: bool,
            dtype: torch.dtype, device: torch.device, state: list[torch.Tensor],
            rebuild: bool = False, save_original: bool = False
            ) -> tuple[SavedForBackward, list[bool]]:
    """The metadata of what forward kept (storages without buffers, and which buffers are
    present): the forward run once on fake tensors of these shapes, cached."""
    key = (plan, tuple(gemms), tuple(m_splits), tuple(x_shape), tuple(weight_shapes),
           tuple(has_bias), need_dgrad, need_wgrad, dtype, str(device), rebuild, save_original)
    layout = _LAYOUTS.get(key)
    if layout is not None:
        return layout
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_state = [mode.from_tensor(t) for t in state]
        x = torch.empty(x_shape, dtype=dtype, device=device)
        shapes = [weight_shapes[i:i + 2] for i in range(0, len(weight_shapes), 2)]
        weights = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        biases = [torch.empty(shape[0], dtype=dtype, device=device) if flag else None
                  for shape, flag in zip(shapes, has_bias, strict=True)]
        call = gemm_call(plan, fake_state, gemms, m_splits, need_dgrad, need_wgrad, rebuild,
                          save_original)
        _, _, saved = gemms_forward(x, call, weights, biases)
    present = [t is not None for t in saved.tensors]
    storages = [_without_tensors(s) for s in saved.x_storages + saved.w_storages]
    count = len(saved.x_storages)
    layout = (SavedForBackward([], storages[:count], storages[count:]), present)
    _LAYOUTS[key] = layout
    return layout


def _without_tensors(storage: QuantizedStorage | None) -> QuantizedStorage | None:
    """A buffer-less storage whose recorded quantizers hold no tensors (no fake tensor outlives
    _layout's fake mode)."""
    if storage is None:
        return None
    storage = storage.detach()
    for holder in [storage, *(getattr(storage, name, None)
                              for name in ("rowwise_storage", "columnwise_storage"))]:
        if holder is not None and holder.quantizer is not None:
            holder.quantizer = quantizer_without_tensors(holder.quantizer)
    return storage


def gemms_backward_impl(
    grad_output: torch.Tensor, saved: list[torch.Tensor], state: list[torch.Tensor], plan: int,
    gemms: list[int], m_splits: list[int], x_shape: list[int], weight_shapes: list[int],
    has_bias: list[bool], need_dgrad: bool, need_wgrad: bool, rebuild_from: list[torch.Tensor],
    rebuild_scales: list[torch.Tensor], grad_output_amax: list[torch.Tensor], reduction: str,
) -> list[torch.Tensor]:
    """[dx if need_dgrad] + [dW_i if need_wgrad] + [db_i where has_bias]; `rebuild_from`: the
    weights, when forward kept no copy of them (empty otherwise), `rebuild_scales`: their
    forward scales under delayed scaling (empty otherwise); `grad_output_amax`: as
    gemms_forward_impl's input_amax, for grad_output. `saved` is in the layout of a forward
    that kept the input's copy (with save_original_input, _backward made it). `reduction`:
    as gemms_forward_impl's."""
    if is_fake(grad_output):
        reduction = ""
    if not state and not is_fake(grad_output) and not reduction:  # one FP8 current GEMM
        lean = lean_ops.lean_plan(plan, gemms, PLANS[plan].stateless)
        if lean is not None and lean_ops.backward_applies(grad_output, x_shape, weight_shapes):
            outputs = lean_ops.lean_backward(grad_output, saved, lean, x_shape, has_bias[0],
                                             need_dgrad, need_wgrad, rebuild_from,
                                             grad_output_amax[0] if grad_output_amax else None)
            return _unaliased([t.contiguous() for t in outputs],
                              [grad_output, *saved, *_buffers(rebuild_from)])
    rebuild = bool(rebuild_from)
    layout, present = _layout(plan, gemms, m_splits, x_shape, weight_shapes, has_bias,
                              need_dgrad, need_wgrad, grad_output.dtype, grad_output.device,
                              state, rebuild)
    buffers = iter(saved)
    x_qs, w_qs = layout.restore([next(buffers) if flag else None for flag in present])
    state = [detached_alias(t) for t in state]
    call = gemm_call(plan, state, gemms, m_splits, need_dgrad, need_wgrad, rebuild,
                      reduction=reduction)
    if rebuild:
        scales = rebuild_scales or [None] * len(rebuild_from)
        w_qs = [rebuild_weight_copy(weight, quantizer, scale) for weight, quantizer, scale
                in zip(rebuild_from, call.weight_quantizers, scales, strict=True)]
    shapes = [torch.Size(weight_shapes[i:i + 2]) for i in range(0, len(weight_shapes), 2)]
    weights = [WeightInfo(shape, grad_output.dtype, grad_output.device) for shape in shapes]
    splits = list(m_splits)
    grad_x, grad_weights, grad_biases = gemms_backward(
        grad_output, call, splits, x_qs, w_qs, weights, has_bias, grad_output.dtype)
    outputs = []
    if need_dgrad:
        outputs.append(grad_x.reshape(x_shape))
    if need_wgrad:
        outputs.extend(grad_weights)
    outputs.extend(g for g in grad_biases if g is not None)
    # contiguous, as the fake implementation's new_empty outputs are
    return _unaliased([t.contiguous() for t in outputs],
                      [grad_output, *saved, *state, *_buffers(rebuild_from), *rebuild_scales])


def gemms_backward_fake(grad_output, saved, state, plan, gemms, m_splits, x_shape,
                         weight_shapes, has_bias, need_dgrad, need_wgrad, rebuild_from,
                         rebuild_scales, grad_output_amax, reduction):
    outputs = []
    if need_dgrad:
        outputs.append(grad_output.new_empty(x_shape))
    shapes = [weight_shapes[i:i + 2] for i in range(0, len(weight_shapes), 2)]
    if need_wgrad:
        outputs.extend(grad_output.new_empty(shape) for shape in shapes)
    outputs.extend(grad_output.new_empty(shape[0])
                   for shape, flag in zip(shapes, has_bias, strict=True) if flag)
    return outputs


_gemms_backward_op = define_op("gemms_backward", gemms_backward_impl, gemms_backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    (x, weights, biases, has_bias, state, plan, gemms, m_splits, need_dgrad, need_wgrad,
     rebuild, save_original, input_amax, reduction) = inputs
    ctx.reduction = reduction
    rebuild_from = list(weights) if rebuild and need_dgrad else []
    originals = [x] if save_original and need_wgrad else []
    # forward's max|x| (current scaling, lean_ops.compiled_amax): the recast's amax
    original_amax = list(input_amax) if originals else []
    ctx.carried = carried_counts(plan, gemms, need_dgrad, need_wgrad, rebuild, save_original)
    carried = sum(ctx.carried)
    kept = output[1:len(output) - carried]
    # state: aliases, see detached_alias; weights (rebuild) and input (save_original): as
    # F.linear keeps them
    ctx.save_for_backward(*kept, *state, *rebuild_from, *originals, *original_amax,
                          *output[len(output) - carried:])
    ctx.saved_count, ctx.bias_count = len(kept), len(biases)
    ctx.rebuild_count, ctx.original_count = len(rebuild_from), len(originals)
    ctx.original_amax_count = len(original_amax)
    ctx.constants = (plan, list(gemms), list(m_splits), list(x.shape),
                     [d for w in weights for d in w.shape], list(has_bias), need_dgrad,
                     need_wgrad)
    ctx.weight_count, ctx.state_count = len(weights), len(state)
    ctx.amax_count = len(input_amax)


def _backward(ctx, grads):
    plan, gemms, m_splits, x_shape, weight_shapes, has_bias, need_dgrad, need_wgrad = (
        ctx.constants)
    tensors = list(ctx.saved_tensors)
    saved = tensors[:ctx.saved_count]
    state = tensors[ctx.saved_count:ctx.saved_count + ctx.state_count]
    rest = iter(tensors[ctx.saved_count + ctx.state_count:])
    rebuild_from = [next(rest) for _ in range(ctx.rebuild_count)]
    originals = [next(rest) for _ in range(ctx.original_count)]
    original_amax = next(rest) if ctx.original_amax_count else None
    weight_scales, input_scales = ctx.carried
    rebuild_scales = [next(rest) for _ in range(weight_scales)]
    scales = tuple(next(rest) for _ in range(input_scales)) or None
    if originals:  # save_original_input: the input's copies, made here (input_recast.py)
        saved = input_copy_buffers(originals[0], slot_quantizers(plan, gemms, 0),
                                   scales, original_amax) + saved
    grad_output = grads[0].contiguous()
    outputs = iter(_gemms_backward_op(grad_output, saved, state, plan, gemms,
                                      m_splits, x_shape, weight_shapes, has_bias, need_dgrad,
                                      need_wgrad, rebuild_from, rebuild_scales,
                                      _lean_amax_backward(grad_output, state, plan, gemms,
                                                          x_shape, weight_shapes),
                                      ctx.reduction))
    grad_x = next(outputs) if need_dgrad else None
    grad_weights = ([next(outputs) for _ in range(ctx.weight_count)] if need_wgrad
                    else [None] * ctx.weight_count)
    grad_biases = [next(outputs) for _ in range(ctx.bias_count)]
    return (grad_x, grad_weights, grad_biases, None, [None] * ctx.state_count, None, None,
            None, None, None, None, None, [None] * ctx.amax_count, None)


INPUT_CURRENT, GRAD_OUTPUT_CURRENT = 1, 2


@torch._dynamo.assume_constant_result
def _lean_current_casts(plan: int, gemm: int) -> int:
    """Which casts of GEMM `gemm`'s lean path (the ops' implementations take it for a
    stateless plan of one GEMM) use current scaling: INPUT_CURRENT | GRAD_OUTPUT_CURRENT bits.
    A constant to dynamo, which does not trace the plan cache this fills."""
    lean = lean_ops.lean_plan(plan, [gemm], PLANS[plan].stateless)
    if lean is None:
        return 0
    return ((INPUT_CURRENT if lean.input.scale is None else 0)
            | (GRAD_OUTPUT_CURRENT if lean.grad_output.scale is None else 0))


@torch._dynamo.assume_constant_result
def _reduces(plan: int, gemms: tuple[int, ...], slots: tuple[str, ...]) -> bool:
    """tp_reduction.reduces_split_maxima for a plan, a constant to dynamo (which then does not
    trace the plan cache)."""
    return reduces_split_maxima(PLANS[plan].forward_prototypes,
                                PLANS[plan].backward_prototypes, list(gemms), frozenset(slots))


@torch._dynamo.assume_constant_result
def _graph_cast_spec(plan: int, gemm: int) -> int:
    """graph_casts.spec_of the lean plan of GEMM `gemm` (0: not served), a constant to dynamo
    as _lean_current_casts is."""
    return graph_casts.spec_of(lean_ops.lean_plan(plan, [gemm], PLANS[plan].stateless))


def _lean_amax_forward(x: torch.Tensor, weights: list[torch.Tensor], state: list[torch.Tensor],
                       plan: int, gemms: list[int]) -> list[torch.Tensor]:
    """[max|x|] in traced torch ops (lean_ops.compiled_amax) where the forward op's lean path
    casts x with current scaling, else []. The device and shape rules are checked here; the
    op's own check (lean_ops.forward_applies) decides, and ignores an amax it does not use
    (under save_original_input the backward's recast of x uses it either way)."""
    if state or len(gemms) != 1 or len(weights) != 1 or x.dim() == 0:
        return []
    if not _lean_current_casts(plan, gemms[0]) & INPUT_CURRENT:
        return []
    n, k = weights[0].shape
    if not lean_ops.shapes_apply(x.device.type, x.dtype, x.numel() // k if k else 0, k, n):
        return []
    return lean_ops.compiled_amax(x)


def _lean_amax_backward(grad_output: torch.Tensor, state: list[torch.Tensor], plan: int,
                        gemms: list[int], x_shape: list[int], weight_shapes: list[int]
                        ) -> list[torch.Tensor]:
    """As _lean_amax_forward, for the backward op's cast of grad_output."""
    if state or len(gemms) != 1:
        return []
    if not _lean_current_casts(plan, gemms[0]) & GRAD_OUTPUT_CURRENT:
        return []
    if not lean_ops.backward_applies(grad_output, x_shape, weight_shapes):
        return []
    return lean_ops.compiled_amax(grad_output)


torch.library.register_autograd("minifloat::gemms_forward", _backward,
                                setup_context=_setup_context)


def compiled_gemms(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
    plan: int, state: list[torch.Tensor], gemms: list[int], m_splits: list[int], *,
    need_dgrad: bool, need_wgrad: bool, rebuild: bool = False, save_original_input: bool = False,
    amax_reduction: tuple[Any, frozenset[str]] | None = None,
) -> torch.Tensor:
    """The module's GEMMs through the custom ops (the path torch.compile traces); `rebuild`:
    keep no weight copy for backward, `save_original_input`: no input copy (where the ops can
    make them in backward: rebuild_applies, save_original_applies). `amax_reduction` (group,
    operand names): a tensor-parallel layer's split operands, whose maxima are all-reduced
    before their casts (tp_reduction.py)."""
    quantized = [isinstance(weight, QuantizedTensor) for weight in weights]
    if any(quantized) and not all(quantized):
        raise NotImplementedError(
            "a module whose weights are partly quantized (QuantizedTensor) and partly high "
            "precision does not run under torch.compile; quantize all its weights or none")
    for weight in weights:
        if getattr(weight, "main_grad", None) is not None:
            raise NotImplementedError(
                "weight.main_grad accumulation does not run under torch.compile yet; "
                "let autograd produce weight.grad")
    # the casts and GEMMs in the traced graph where inductor compiles without CUDA graphs
    # (graph_casts.wanted); gemm_op's ops otherwise. Either reduces a tensor-parallel group's
    # maxima: graph_casts in the graph, the ops inside the op
    if amax_reduction is not None and not _reduces(plan, tuple(gemms),
                                                   tuple(sorted(amax_reduction[1]))):
        amax_reduction = None  # nothing per call to reduce: the ops run as without TP
    spec = (_graph_cast_spec(plan, gemms[0])
            if not state and len(gemms) == 1 and len(weights) == 1 else 0)
    if spec and graph_casts.applies(spec, x, weights[0]) and graph_casts.wanted():
        group, slots = amax_reduction or (None, frozenset())
        return graph_casts.GraphCastGemm.apply(
            x, weights[0], biases[0], spec, need_dgrad, need_wgrad,
            rebuild and rebuild_applies(plan, gemms), save_original_input,
            graph_casts.reduce_mask_of(slots), group)
    has_bias = [b is not None for b in biases]
    present = [b for b in biases if b is not None]
    # the ops reduce a TP group's maxima inside (the quantizers' collective, as eager runs
    # it); the input's recast in backward would not (input_recast), so its copy is kept
    reduction = reduction_key(amax_reduction)
    save_original = (save_original_input and save_original_applies(plan, gemms)
                     and not reduction)
    outputs = _gemms_forward_op(x, list(weights), present, has_bias, list(state),
                                plan, list(gemms), [int(m) for m in m_splits],
                                need_dgrad, need_wgrad,
                                # quantized weights: backward derives their columnwise copies
                                # from them (quantized_weight_ops.py)
                                any(quantized) or (rebuild and rebuild_applies(plan, gemms)),
                                save_original,
                                _lean_amax_forward(x, list(weights), list(state), plan,
                                                   list(gemms)), reduction)
    return outputs[0]


# QuantizedTensor weights reach the ops above through their dispatch: the handlers registered
# there pass the weights' buffers to the ops' twins
from . import quantized_weight_ops  # noqa: E402, F401
