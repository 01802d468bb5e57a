"""What every quantized module shares: slot roles, recipe states, weights, running its GEMMs.

A module has `num_gemms` GEMMs; each owns the linear slot layout: forward [input, weight,
output], backward [grad_output, grad_input], repeated per GEMM. An output slot carries the role
of its consumer's input and a grad_input slot the role of its consumer's grad_output
(QuantizerRole has no "output" type, see seed 001); modules with internal boundaries
(LayerNormMLP: fc1 -> fc2) label them with the inner consumer.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .. import kernels
from ..autocast import (
    active_token,
    get_autocast_state,
    get_quantized_init_state,
    note_delayed_use,
    recipe_for_token,
    register_delayed_states,
)
from ..quantizers import HybridQuantizer, QuantizedTensor, Quantizer
from ..quantizers.base import kernel_module
from ..recipe_state import RecipeState
from ..recipes import QuantizerRole, Recipe
from . import extra_state
from .gemm_op import (
    GemmBinding,
    compiled_gemms,
    detached_alias,
    note_compiled_delayed_use,
)
from .gemm_plans import register_plan
from .lean_fp8 import LeanFP8Gemm, LeanPlan, batched_weight_copies
from .lean_fp8 import applies as lean_applies
from .linear_function import (  # noqa: F401 - the slot names are part of base's API
    BACKWARD_SLOTS,
    FORWARD_SLOTS,
    GemmCall,
    LinearGemms,
    as_output,
)
from .tp_reduction import with_amax_group
from .weights import (
    dequantized_weight,
    runs_dequantized,
    weight_cache_for,
    weights_quantized_once,
)

# Every live module, so that the first compiled trace under a recipe can bind them all at once
# (bind_live_modules): a module whose binding exists before its trace adds no guard of its own.
_LIVE_MODULES: weakref.WeakSet = weakref.WeakSet()


@torch.compiler.assume_constant_result
def bind_live_modules(token: int) -> int:
    """Bind every live module (off the meta device) to the recipe of `token`. Under
    torch.compile this runs at trace time only and its result is a constant, so neither the
    binding's Python nor any module identity enters the graph or its guards: blocks compiled
    one by one find their bindings ready and share one graph. It also allocates the kernels'
    persistent buffers of the modules' CUDA devices, which the first kernel launch would
    otherwise allocate inside a cudagraph-tree warm-up (per_tensor_fp8.prepare_sync_pool)."""
    devices = set()
    for module in list(_LIVE_MODULES):
        device = module._state_device()
        if token not in module._bindings and device.type != "meta":
            module.binding(token)
        if device.type == "cuda":
            devices.add(device)
    if devices and kernels.triton_importable():
        for device in devices:
            kernel_module("per_tensor_fp8").prepare_sync_pool(device)
    return 0


def _allow_missing_extra_state(module: QuantizedModule, state_dict: dict, prefix: str,
                               *args) -> None:
    extra_state.missing_extra_state(state_dict, prefix, module.name)


HYBRID_COMPILE_REFUSAL = (
    "hybrid quantized weights (a format per direction) do not run under torch.compile yet; "
    "compile with high-precision weights (outside quantized_model_init, and under FSDP2 without "
    "enable_low_precision_all_gather), or run eagerly")


class QuantizedModule(nn.Module):
    """Base of minifloat's GEMM modules: roles, per-recipe quantizers and the weight cache."""

    module_type = "linear"
    num_gemms = 1
    # True: keep no weight copy from forward to backward; backward quantizes the weight again
    # (linear_function.rebuild_weight_copy). For FSDP2, whose sharding a kept full-size copy
    # undoes; distributed.rebuild_weight_copies_in_backward sets it on a model's modules. Under
    # torch.compile the ops honour it for stateless recipes and plain delayed scaling.
    rebuild_weight_copy_in_backward = False
    # why this module's weights cannot run under torch.compile (None: they can): hybrid
    # quantized weights (new_weight), and gathers whose backward re-gather brings other bytes
    # than forward's (delayed scaling, MXFP8: enable_low_precision_all_gather), which only the
    # eager path follows
    compile_refusal: str | None = None
    # True (TransformerEngine's save_original_input): keep the high-precision input for wgrad
    # instead of its columnwise copy; backward quantizes it again
    # (linear_function.rebuild_input_copies). Eagerly it keeps 2 bytes an element where the
    # copy keeps 1 (a win only where the input is kept anyway, e.g. SDPA's output); under
    # torch.compile the partitioner recomputes a norm's or an activation's output from what
    # those keep anyway, so nothing input-sized is kept at all. Set by save_original_inputs.
    save_original_input = False
    # set by new_weight under quantized_model_init: a plain weight arriving later is reported once
    _built_with_quantized_weights = False

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name or ""
        self.output_consumer_role: QuantizerRole | None = None
        self.grad_input_consumer_role: QuantizerRole | None = None
        self._recipe_states: dict[Recipe, tuple[RecipeState, RecipeState]] = {}
        self._quantizers: dict[Recipe, tuple[list[Quantizer], list[Quantizer]]] = {}
        self._delayed_handles: dict[Recipe, object] = {}  # keep autocast's registrations alive
        # autocast.recipe_token -> GemmBinding: what a call needs, resolved once per recipe
        self._bindings: dict[int, GemmBinding] = {}
        # token -> (plan, state): what the compiled path reads (a tuple, so dynamo guards on
        # its values, equal across blocks, not on an object's identity)
        self._compiled_args: dict[int, tuple[int, list[torch.Tensor]]] = {}
        _LIVE_MODULES.add(self)
        # id(weight) -> its kept quantization (is_first_microbatch=True keeps, False reuses);
        # weights.ONCE_KEY -> the same for a quantize_weights_once block, with dequantized copies
        self._weight_cache: dict = {}
        # recipe state loaded from a checkpoint, applied at the recipe's first use (extra_state.py)
        self._pending_recipe_state: list[dict] = []
        self.register_load_state_dict_pre_hook(_allow_missing_extra_state)

    def __setstate__(self, state: dict) -> None:
        """A copy (copy.deepcopy, pickle) is a live module too: bind_live_modules binds it
        before torch.compile traces it (its binding cannot be made while tracing)."""
        super().__setstate__(state)
        _LIVE_MODULES.add(self)

    # ---- roles ----

    def gemm_name(self, gemm: int) -> str:
        """The layer name in the roles of GEMM `gemm` (LayerNormMLP: fc1_name / fc2_name)."""
        return self.name

    def output_role(self, gemm: int) -> QuantizerRole:
        """Role of GEMM `gemm`'s output slot: its consumer's input."""
        return self.output_consumer_role or QuantizerRole("linear", "input", self.gemm_name(gemm))

    def grad_input_role(self, gemm: int) -> QuantizerRole:
        """Role of GEMM `gemm`'s grad_input slot: its consumer's grad_output."""
        return self.grad_input_consumer_role or QuantizerRole(
            "linear", "grad_output", self.gemm_name(gemm))

    def get_quantizer_roles(self, forward: bool) -> list[QuantizerRole]:
        """Roles of this module's forward or backward slots, in slot order."""
        roles = []
        for gemm in range(self.num_gemms):
            name = self.gemm_name(gemm)
            if forward:
                roles += [QuantizerRole(self.module_type, "input", name),
                          QuantizerRole(self.module_type, "weight", name),
                          self.output_role(gemm)]
            else:
                roles += [QuantizerRole(self.module_type, "grad_output", name),
                          self.grad_input_role(gemm)]
        return roles

    def set_consumer_roles(
        self, output: QuantizerRole | None = None, grad_input: QuantizerRole | None = None
    ) -> None:
        """Say who consumes this module's output (and so its grad_input)."""
        if output is not None:
            self.output_consumer_role = output
        if grad_input is not None:
            self.grad_input_consumer_role = grad_input
        self._recipe_states.clear()
        self._quantizers.clear()
        self._delayed_handles.clear()
        self._bindings.clear()
        self._compiled_args.clear()

    # ---- quantizers ----

    def recipe_states(self, recipe: Recipe) -> tuple[RecipeState, RecipeState]:
        """Forward and backward states for `recipe` (created once, kept across steps; delayed
        scaling ones are enrolled in autocast's updates, see autocast.py)."""
        if recipe not in self._recipe_states:
            device = self._state_device()
            forward_roles = self.get_quantizer_roles(True)
            backward_roles = self.get_quantizer_roles(False)
            forward = RecipeState.create(recipe, "forward", len(forward_roles), forward_roles,
                                         device)
            backward = RecipeState.create(recipe, "backward", len(backward_roles),
                                          backward_roles, device)
            self._recipe_states[recipe] = (forward, backward)
            self._pending_recipe_state = extra_state.apply_pending(
                self._pending_recipe_state, recipe, forward, backward, self._display_name())
            if forward.tracks_amax_history or backward.tracks_amax_history:
                self._delayed_handles[recipe] = register_delayed_states(recipe, forward,
                                                                        backward)
        return self._recipe_states[recipe]

    # ---- checkpoints: recipe state as _extra_state (extra_state.py) ----

    def get_extra_state(self) -> bytes:
        """Every recipe's state tensors (delayed scaling: scales and amax histories), and any
        loaded state not used yet, so that save -> load -> save keeps it; serialized
        (extra_state.decode reads it back)."""
        state = extra_state.recipe_state_dict(self._recipe_states)
        state["recipes"] += self._pending_recipe_state
        return extra_state.encode(state)

    def set_extra_state(self, state) -> None:
        entries = extra_state.pending_entries(state, self._display_name())
        for recipe, (forward, backward) in self._recipe_states.items():
            entries = extra_state.apply_pending(entries, recipe, forward, backward,
                                                self._display_name())
        self._pending_recipe_state = entries

    def drop_loaded_recipe_state(self) -> None:
        """Forget recipe state loaded from a checkpoint and not yet used (e.g. to train the
        loaded weights under another recipe, starting its histories afresh)."""
        self._pending_recipe_state = []

    def _display_name(self) -> str:
        return self.name or type(self).__name__

    def quantizers(self, recipe: Recipe) -> tuple[list[Quantizer], list[Quantizer]]:
        """(forward, backward) quantizers for `recipe`, built once and reused."""
        if recipe not in self._quantizers:
            forward, backward = self.recipe_states(recipe)
            self._quantizers[recipe] = (forward.make_quantizers(), backward.make_quantizers())
        return self._quantizers[recipe]

    def binding(self, token: int) -> GemmBinding:
        """Everything a call under the recipe of `token` needs, resolved once (not per call):
        quantizers, the compiled op's plan id and the state tensors it passes."""
        binding = self._bindings.get(token)
        if binding is None:
            recipe = recipe_for_token(token)
            forward, backward = self.recipe_states(recipe)
            forward_quantizers, backward_quantizers = self.quantizers(recipe)
            binding = GemmBinding(
                forward_quantizers=forward_quantizers,
                backward_quantizers=backward_quantizers,
                plan=register_plan(forward, backward, forward_quantizers,
                                   backward_quantizers),
                state=[detached_alias(t)
                       for t in forward.state_tensors() + backward.state_tensors()],
                delayed_pair=self._delayed_handles.get(recipe),
                recipe_states=(forward, backward),
                lean_plans=[LeanPlan.for_quantizers(
                    forward_quantizers[len(FORWARD_SLOTS) * g],
                    forward_quantizers[len(FORWARD_SLOTS) * g + 1],
                    backward_quantizers[len(BACKWARD_SLOTS) * g]) for g in range(self.num_gemms)],
                row_multiples=[math.lcm(
                    forward_quantizers[len(FORWARD_SLOTS) * g].row_multiple(),
                    backward_quantizers[len(BACKWARD_SLOTS) * g].row_multiple())
                    for g in range(self.num_gemms)],
                cuda_row_multiples=[math.lcm(
                    forward_quantizers[len(FORWARD_SLOTS) * g].row_multiple(),
                    forward_quantizers[len(FORWARD_SLOTS) * g].fast_gemm_row_multiple(),
                    backward_quantizers[len(BACKWARD_SLOTS) * g].row_multiple(),
                    backward_quantizers[len(BACKWARD_SLOTS) * g].fast_gemm_row_multiple())
                    for g in range(self.num_gemms)],
            )
            for tensor in binding.state:
                # the ops record amaxes into these in place: CUDA graphs (reduce-overhead) must
                # read and write them where they are, not through a static copy of the input
                torch._dynamo.mark_static_address(tensor, guard=False)
            if binding.delayed_pair is not None:
                note_compiled_delayed_use(binding.state, binding.delayed_pair)
            self._bindings[token] = binding
            self._compiled_args[token] = (binding.plan, binding.state)
        return binding

    def _run_rows_padded(self, x: torch.Tensor, multiple: int, weights: list[torch.Tensor],
                         biases: list[torch.Tensor | None], gemms: list[int],
                         is_first_microbatch: bool | None, amax_reduction) -> torch.Tensor:
        """Any token count under formats whose blocks run along the rows (MXFP8 32, NVFP4 16),
        and on CUDA whole row groups for the fast GEMMs (scaled_mm 16, blockwise 128): zero rows
        pad x to the multiple, the output keeps the real rows. Exact: a zero row raises no
        block's amax and quantizes to zeros, its output rows are dropped, and their gradient is
        zero, so the weight gradient sums the real rows only. Costs a copy of x (ragged batches;
        generation takes quantize_weights_once's small-M rule and pads nothing)."""
        rows = x.numel() // x.shape[-1]
        padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % multiple))
        y = self.run_gemms(padded, [padded.shape[0]], weights, biases, gemms,
                           is_first_microbatch=is_first_microbatch,
                           amax_reduction=amax_reduction)
        return y[:rows].reshape(*x.shape[:-1], y.shape[-1])

    def _run_dequantized_weights(self, x: torch.Tensor, m_splits: list[int],
                                 weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                                 gemms: list[int], token: int) -> torch.Tensor:
        """The small-M rule of quantize_weights_once: x (not quantized) against each weight's
        quantization, dequantized once per block; no row padding is needed."""
        binding = self._bindings.get(token) or self.binding(token)
        pieces = [x] if len(weights) == 1 else torch.split(x.reshape(-1, x.shape[-1]), m_splits)
        outputs = [
            F.linear(piece, dequantized_weight(
                self._weight_cache, weight,
                binding.forward_quantizers[len(FORWARD_SLOTS) * gemm + 1], x.dtype), bias)
            for piece, weight, bias, gemm in zip(pieces, weights, biases, gemms, strict=True)]
        if len(weights) == 1:
            return outputs[0]
        return as_output(torch.cat(outputs), (*x.shape[:-1], weights[0].shape[0]))

    def _report_dequantized_weights(self, weight: torch.Tensor) -> None:
        """Say (once) that weights built quantized now arrive in high precision. The usual
        cause: FSDP2's fully_shard splits parameters with tensor ops, and a QuantizedTensor
        answers those with its high-precision values, so the shards (and what the optimizer
        updates) are no longer quantized."""
        self._built_with_quantized_weights = False
        warnings.warn(
            f"{type(self).__name__} {self.name!r} was built under quantized_model_init, but its "
            f"weight now arrives as a high-precision {type(weight).__name__}: it is no longer "
            "stored quantized (FSDP2's fully_shard split the QuantizedTensor weight with tensor "
            "ops, which answer with high-precision values). Training goes on in high-precision "
            "weights. To shard per-tensor FP8 weights as bytes, call "
            "minifloat.distributed.enable_low_precision_all_gather(model, recipe) before "
            "fully_shard and update them with quantize_master_weights; other formats: build "
            "the model without quantized_model_init",
            stacklevel=3)

    def _state_device(self) -> torch.device:
        """Where recipe states (delayed-scaling scales, histories) live: with the parameters, or,
        while the first weight is being built (quantized_model_init), where it is built."""
        for parameter in self.parameters():
            return parameter.device
        return getattr(self, "_device_hint", torch.device("cpu"))

    @contextlib.contextmanager
    def delayed_scaling_scope(self, recipe: Recipe):
        """Note this call's delayed-scaling states in autocast's round; inside
        minifloat.checkpoint also record the scales the call uses, and during the recompute put
        them back for the call, so it quantizes exactly as the original forward did (and
        records no amax)."""
        record = get_autocast_state().recompute_record
        forward, _ = self.recipe_states(recipe)
        pair = self._delayed_handles.get(recipe)
        if pair is not None and (record is None or not record.replaying):
            note_delayed_use(pair)
        if record is None or not forward.tracks_amax_history:
            yield
        elif record.replaying:
            with record.replay(forward.delayed_states()):
                yield
        else:
            record.stash(forward.delayed_states())
            yield

    # ---- weights ----

    def new_weight(self, out_features: int, in_features: int, dtype: torch.dtype,
                   device: torch.device | str | None, gemm: int = 0) -> nn.Parameter:
        """A weight initialised like nn.Linear's; a QuantizedTensor under quantized_model_init
        (in the format of GEMM `gemm`'s weight slot, both copies)."""
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self._device_hint = weight.device
        init = get_quantized_init_state()
        if not init["enabled"]:
            return nn.Parameter(weight)
        if init["keep_high_precision_copy"]:
            suffix = "" if self.num_gemms == 1 else str(gemm)
            setattr(self, f"weight{suffix}_hp_init", weight.detach().clone())
        self._built_with_quantized_weights = True
        weight_quantizer = self.quantizers(init["recipe"])[0][len(FORWARD_SLOTS) * gemm + 1]
        weight_quantizer = weight_quantizer.copy()
        weight_quantizer.set_usage(rowwise=True, columnwise=True)
        weight_quantizer.internal = False
        if isinstance(weight_quantizer, HybridQuantizer):
            self.compile_refusal = HYBRID_COMPILE_REFUSAL
        return nn.Parameter(weight_quantizer(weight))

    @staticmethod
    def new_bias(out_features: int, in_features: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> nn.Parameter:
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        return nn.Parameter(
            torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound))

    # ---- running GEMMs ----

    def gather_input_quantized(self, gemm: int, rows: int) -> bool:
        """Whether GEMM `gemm`'s input (`rows` rows on this rank), under the active recipe,
        can be gathered for sequence parallelism as its quantized bytes (per-tensor FP8, MXFP8
        on whole blocks: distributed/sequence_gather.py); eager only (a compiled graph
        gathers in high precision)."""
        token = active_token()
        if token == 0 or torch.compiler.is_compiling():
            return False
        from ..distributed.sequence_gather import gathers_quantized

        binding = self._bindings.get(token) or self.binding(token)
        return gathers_quantized(binding.forward_quantizers[len(FORWARD_SLOTS) * gemm], rows)

    def run_gemms(
        self,
        x: torch.Tensor,
        m_splits: list[int],
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        gemms: list[int],
        is_first_microbatch: bool | None = None,
        amax_reduction: tuple[Any, frozenset[str]] | None = None,
        input_gather_group: Any = None,
        output_scatter_group: Any = None,
    ) -> torch.Tensor:
        """cat_i(x_i W_i^T + b_i) over the row splits, GEMM i using the slots of `gemms[i]`.

        `amax_reduction` (group, slot names): tensor-parallel layers quantize those operands
        (e.g. {"weight", "grad_output"}) with their amax all-reduced over the group, through
        quantizer copies that hold it for this call only (seed 003). `input_gather_group`:
        x is this rank's rows of a sequence-parallel input, quantized here and all-gathered
        as FP8 bytes (per-tensor FP8 input quantizers only: gather_input_quantized).
        `output_scatter_group`: the output's rows are reduce-scattered over it (a
        sequence-parallel row-parallel layer) and backward gathers the gradient's rows, as FP8
        bytes where the format allows.

        `is_first_microbatch` (TransformerEngine's flag): None quantizes the weights afresh;
        True quantizes them and keeps the copies; False reuses the kept copies (the weights have
        not changed since: later micro-batches of one step). See modules/weights.py.

        Outside autocast: plain F.linear per split (quantized weights dequantized).
        """
        token = active_token()
        if token == 0:
            if len(weights) == 1:  # exactly what a plain nn.Linear runs (same cost, no view)
                return F.linear(x, plain_weight(weights[0]), biases[0])
            pieces = torch.split(x.reshape(-1, x.shape[-1]), m_splits)
            outputs = [F.linear(piece, plain_weight(w), b)
                       for piece, w, b in zip(pieces, weights, biases, strict=True)]
            return as_output(torch.cat(outputs), (*x.shape[:-1], weights[0].shape[0]))
        if (input_gather_group is None and output_scatter_group is None
                and amax_reduction is None and runs_dequantized(sum(m_splits))):
            return self._run_dequantized_weights(x, m_splits, weights, biases, gemms, token)
        if len(weights) == 1 and input_gather_group is None and output_scatter_group is None:
            if torch.compiler.is_compiling():
                bind_live_modules(token)
            binding = self._bindings.get(token) or self.binding(token)
            multiple = binding.rows_multiple(gemms[0], x)
            if multiple > 1 and m_splits[0] % multiple:
                return self._run_rows_padded(x, multiple, weights, biases, gemms,
                                             is_first_microbatch, amax_reduction)
        if torch.compiler.is_compiling() and self.compile_refusal is not None:
            raise NotImplementedError(f"{self.name or type(self).__name__}: "
                                      f"{self.compile_refusal}")
        grad_enabled = torch.is_grad_enabled()
        need_dgrad = grad_enabled and x.requires_grad
        need_wgrad = grad_enabled and any(w.requires_grad for w in weights)
        if torch.compiler.is_compiling():
            if is_first_microbatch is not None:
                raise ValueError(
                    "is_first_microbatch keeps quantized weights between calls, which a "
                    "compiled graph cannot; leave it None under torch.compile")
            bind_live_modules(token)
            plan, state = self._compiled_args[token]
            return compiled_gemms(x, weights, biases, plan, state, gemms, m_splits,
                                  need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                                  rebuild=self.rebuild_weight_copy_in_backward,
                                  save_original_input=self.save_original_input,
                                  amax_reduction=amax_reduction)
        binding = self._bindings.get(token) or self.binding(token)
        if self._built_with_quantized_weights and not isinstance(weights[0], QuantizedTensor):
            self._report_dequantized_weights(weights[0])
        elif (isinstance(weights[0], QuantizedTensor)
              and not weights[0].quantized_storage.has_rowwise()):
            raise ValueError(
                f"{self.name or type(self).__name__}: the weight holds only its columnwise "
                "copy, the one an FSDP2 low-precision re-gather brings for backward (MXFP8 and "
                "hybrid weights gather one direction per gather), but a forward is running: a "
                "recompute (minifloat.checkpoint) of a module whose weights FSDP2 re-gathered "
                "for backward first. Gather these weights in high precision (fully_shard "
                "without enable_low_precision_all_gather) or do not checkpoint these modules")
        rebuild = self.rebuild_weight_copy_in_backward
        forward_quantizers = binding.forward_quantizers
        backward_quantizers = binding.backward_quantizers
        if amax_reduction is not None:
            forward_quantizers, backward_quantizers = with_amax_group(
                forward_quantizers, backward_quantizers, *amax_reduction)
        elif (is_first_microbatch is None and len(weights) == 1 and input_gather_group is None
              and output_scatter_group is None and not weights_quantized_once()):
            lean = binding.lean_plans[gemms[0]]
            if lean is not None and lean_applies(x, weights[0]):
                delayed = binding.delayed_pair is not None
                if not delayed or get_autocast_state().recompute_record is None:
                    if delayed:
                        note_delayed_use(binding.delayed_pair)
                    copies = batched_weight_copies(self, weights[0], lean, need_wgrad,
                                                   rebuild and need_dgrad)
                    return LeanFP8Gemm.apply(x, weights[0], biases[0], lean, need_dgrad,
                                             need_wgrad, rebuild, self.save_original_input,
                                             copies)
        if isinstance(x, DTensor) or isinstance(weights[0], DTensor):
            raise TypeError(
                f"{self.name or type(self).__name__}: a DTensor operand (torch's "
                "parallelize_module with ColwiseParallel / RowwiseParallel, or another DTensor "
                "layout) is not quantized by minifloat modules: build the module with "
                "TransformerEngine's arguments instead, e.g. Linear(in_features, out_features, "
                "tp_group=group, parallel_mode='column' or 'row', sequence_parallel=...); "
                "FSDP2 (fully_shard) works as is")
        weight_cache, reuse_weights = weight_cache_for(self._weight_cache, is_first_microbatch)
        call = GemmCall.from_slots(
            forward_quantizers, backward_quantizers, gemms, m_splits,
            need_dgrad=need_dgrad, need_wgrad=need_wgrad, weight_cache=weight_cache,
            reuse_weights=reuse_weights, rebuild_weights=rebuild,
            save_original_input=self.save_original_input,
            input_gather_group=input_gather_group,
            output_scatter_group=output_scatter_group)
        if binding.delayed_pair is not None:
            if get_autocast_state().recompute_record is not None:
                with self.delayed_scaling_scope(recipe_for_token(token)):
                    return LinearGemms.apply(x, call, *weights, *biases)
            note_delayed_use(binding.delayed_pair)
        return LinearGemms.apply(x, call, *weights, *biases)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor for high-precision math (a QuantizedTensor is dequantized)."""
    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
