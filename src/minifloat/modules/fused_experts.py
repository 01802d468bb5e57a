"""A mixture of experts' fused expert weights on minifloat's grouped GEMMs.

transformers keeps the experts of Mixtral, Qwen-MoE and their kin as two 3-D parameters,
`gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F], and runs them token group by token group
(`forward(hidden_states, top_k_index, top_k_weights)`). `FusedExperts` takes those parameters
as they are (same names, so state dicts and save_pretrained keep their keys) and runs the same
computation as two grouped GEMMs: the tokens sorted by expert, each expert's rows through its
slice of each weight, with a quantizer per expert and GEMM (QuantizerRole module_type
"grouped_linear", names `<name>.gate_up_proj` and `<name>.down_proj`). The router stays in high
precision (convert_model does not touch it).

Where a format's blocks run along the rows (MXFP8 32, NVFP4 16), or on CUDA where its fast GEMM
needs whole row groups (scaled_mm 16, blockwise 128), each expert's rows are padded with zero
rows to the multiple (exact: a zero row changes no amax and its output is dropped). Unpadded,
an H200 ran most expert GEMMs of a Mixtral decoded and emulated: 2.5x slower than bf16.
Under per-tensor FP8 current scaling, MXFP8, FP8 block scaling (power-of-2 scales), NVFP4 and
delayed scaling (experts' output widths in whole 128s) the experts run on the
device-offsets path (grouped_offsets.py, grouped_offsets_blocks.py, grouped_offsets_nvfp4.py,
grouped_offsets_delayed.py): the routing layout, the casts and the grouped GEMMs take the
groups as a device tensor, nothing is read on the host, so the module traces into a compiled
graph (fullgraph) and an eager step does not wait for the GPU. MINIFLOAT_MOE_OFFSETS picks where:
`compiled` (the default: under torch.compile; eagerly the lean path below), `always`, `never`.

Otherwise (shapes whose blocks would cross experts, NVFP4 with the RHT on one wgrad operand
only, delayed scaling where the above does not hold) the token counts per expert are read on the
host, as transformers' own loop does; so under torch.compile that path runs eagerly
(torch.compiler.disable: one graph break at the call, no recompile per routing). Under
per-tensor FP8 (current or delayed scaling), eagerly, each grouped GEMM takes the lean grouped
path (lean_grouped_fp8.py: one grouped FP8 GEMM in forward); everything else runs the experts'
GEMMs through run_gemms.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from itertools import accumulate

import torch
from torch import nn

from ..autocast import active_token, get_autocast_state
from . import lean_grouped_fp8
from .base import QuantizedModule, bind_live_modules
from .expert_rows import CombineRows, DispatchRows, pair_positions
from .gemm_op import GemmBinding
from .grouped_offsets import (
    GroupedOffsetsFP8,
    OffsetsCasts,
    routing_layout,
    rows_cast_weights,
    uniform_dtypes,
)
from .grouped_offsets_blocks import GroupedOffsetsBlocks, OffsetsBlocks, offsets_blocks
from .grouped_offsets_delayed import GroupedOffsetsDelayed, OffsetsDelayed, offsets_delayed
from .grouped_offsets_nvfp4 import GroupedOffsetsNVFP4, OffsetsNVFP4, offsets_nvfp4
from .lean_fp8 import LeanPlan
from .lean_grouped_fp8 import LeanGroupedFP8
from .linear_function import BACKWARD_SLOTS, FORWARD_SLOTS
from .weights import runs_dequantized, weights_quantized_once

# a device-offsets plan: one per recipe family the path serves
OffsetsPlan = OffsetsCasts | OffsetsBlocks | OffsetsNVFP4 | OffsetsDelayed

# where the device-offsets path runs (module docstring): compiled, always or never
OFFSETS_MODE = os.environ.get("MINIFLOAT_MOE_OFFSETS", "compiled")
if OFFSETS_MODE not in ("compiled", "always", "never"):
    raise ValueError(f"MINIFLOAT_MOE_OFFSETS={OFFSETS_MODE!r}: use compiled, always or never")


@contextlib.contextmanager
def offsets_mode(mode: str) -> Iterator[None]:
    """MINIFLOAT_MOE_OFFSETS for the calls inside (benchmarks compare the paths in one run)."""
    global OFFSETS_MODE
    if mode not in ("compiled", "always", "never"):
        raise ValueError(f"offsets_mode({mode!r}): use compiled, always or never")
    kept, OFFSETS_MODE = OFFSETS_MODE, mode
    try:
        yield
    finally:
        OFFSETS_MODE = kept


class FusedExperts(QuantizedModule):
    """Experts of transformers' fused layout on grouped GEMMs: GEMM e is expert e's gate_up
    projection, GEMM E + e its down projection."""

    module_type = "grouped_linear"

    def __init__(self, experts: nn.Module, name: str | None = None) -> None:
        super().__init__(name)
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.num_experts = self.gate_up_proj.shape[0]
        self.num_gemms = 2 * self.num_experts
        # (recipe token, first GEMM) -> (binding, lean grouped plan or None): module_plan's
        self._grouped_plans: dict[tuple[int, int], tuple] = {}

    def gemm_name(self, gemm: int) -> str:
        part = "gate_up_proj" if gemm < self.num_experts else "down_proj"
        return f"{self.name}.{part}" if self.name else part

    def _row_multiple(self, x: torch.Tensor) -> int:
        token = active_token()
        if token == 0:
            return 1
        binding = self._bindings.get(token) or self.binding(token)
        return math.lcm(*(binding.rows_multiple(gemm, x) for gemm in range(self.num_gemms)))

    def binding(self, token: int) -> GemmBinding:
        """QuantizedModule's binding, and with it this recipe's device-offsets plan (FP8
        current scaling's casts, the block formats', NVFP4's, delayed scaling's dtypes, or
        None), kept per recipe token so that a compiled forward reads a constant."""
        binding = super().binding(token)
        plan = offsets_casts(binding.lean_plans)
        if plan is None:
            gemms = range(self.num_gemms)
            forward, backward = binding.forward_quantizers, binding.backward_quantizers
            quantizers = ([forward[len(FORWARD_SLOTS) * g] for g in gemms],
                          [forward[len(FORWARD_SLOTS) * g + 1] for g in gemms],
                          [backward[len(BACKWARD_SLOTS) * g] for g in gemms])
            plan = offsets_blocks(*quantizers) or offsets_nvfp4(*quantizers)
        if plan is None:
            plan = offsets_delayed(binding.lean_plans, binding.recipe_states)
        # (a module unpickled from before this cache existed gets one here)
        self.__dict__.setdefault("_offsets_plans", {})[token] = plan
        return binding

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        plan = self._device_offsets_plan(hidden_states, top_k_index.numel())
        if plan is None:
            return self._forward_host_counts(hidden_states, top_k_index, top_k_weights)
        top_k = top_k_index.shape[-1]
        layout = routing_layout(top_k_index, self.num_experts)
        x = DispatchRows.apply(hidden_states, layout.pair_of_row, layout.pair_row, top_k)
        grad = torch.is_grad_enabled()

        function = {OffsetsCasts: GroupedOffsetsFP8, OffsetsBlocks: GroupedOffsetsBlocks,
                    OffsetsNVFP4: GroupedOffsetsNVFP4}.get(type(plan))

        def experts_gemm(inputs: torch.Tensor, weight: torch.Tensor, part: int) -> torch.Tensor:
            need_dgrad, need_wgrad = grad and inputs.requires_grad, grad and weight.requires_grad
            if isinstance(plan, OffsetsDelayed):  # the binding's recipe-state tensors
                state = self._compiled_args[active_token()][1]
                return GroupedOffsetsDelayed.apply(
                    inputs, weight, layout.ends, plan, part * self.num_experts, need_dgrad,
                    need_wgrad, self.rebuild_weight_copy_in_backward, self.save_original_input,
                    *state)
            return function.apply(inputs, weight, layout.ends, plan, need_dgrad, need_wgrad,
                                  self.rebuild_weight_copy_in_backward,
                                  self.save_original_input)

        gate, up = experts_gemm(x, self.gate_up_proj, 0).chunk(2, dim=-1)
        out = experts_gemm(self.act_fn(gate) * up, self.down_proj, 1)
        return CombineRows.apply(out, top_k_weights, layout.pair_row, layout.pair_of_row,
                                 hidden_states.dtype)

    def _device_offsets_plan(self, x: torch.Tensor, pairs: int) -> OffsetsPlan | None:
        """The device-offsets path's plan for this call (FP8 current scaling's casts, the block
        formats', NVFP4's, delayed scaling's dtypes), or None: its mode, outside autocast, another
        recipe, inside quantize_weights_once, a small-M call that runs dequantized weights, or
        operands the path does not take."""
        compiling = torch.compiler.is_compiling()
        if OFFSETS_MODE == "never" or (OFFSETS_MODE == "compiled" and not compiling):
            return None
        token = active_token()
        if token == 0 or weights_quantized_once() or runs_dequantized(pairs):
            return None
        if compiling:
            bind_live_modules(token)
        elif token not in self._bindings:
            self.binding(token)
        plan = self.__dict__.get("_offsets_plans", {}).get(token)
        if plan is None or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16,
                                                             torch.float32):
            return None
        for weight in (self.gate_up_proj, self.down_proj):
            if (type(weight) not in (nn.Parameter, torch.Tensor) or weight.dim() != 3
                    or weight.shape[1] % 16 or weight.shape[2] % 16):
                return None
            if isinstance(plan, OffsetsBlocks) and not blocks_fit(plan, x, weight):
                return None
            if isinstance(plan, OffsetsDelayed) and not rows_cast_weights(*weight.shape):
                return None
        if isinstance(plan, OffsetsDelayed) and get_autocast_state().recompute_record is not None:
            return None  # the host-count path's general GEMMs replay forward's scales there
        return plan

    # The host-counts path: eager under torch.compile too (one graph break at the call, the
    # rest of the model stays compiled): the token counts are read on the host, and a traced
    # forward turned every step's counts into guards, recompiling until dynamo's limit;
    # eagerly the experts take the lean grouped path
    @torch.compiler.disable
    def _forward_host_counts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
        experts, top_k = self.num_experts, top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # (token, slot) pairs grouped by expert
        # scatter_add, not bincount: CUDA's bincount reads the input's maximum on the host (a
        # second synchronisation before the one tolist() needs)
        counts = chosen.new_zeros(experts).scatter_add_(0, chosen, torch.ones_like(chosen))
        counts = counts.tolist()
        # (calls that quantize_weights_once's small-M rule runs against dequantized weights
        # need no padding)
        multiple = 1 if runs_dequantized(chosen.numel()) else self._row_multiple(hidden_states)
        padded = [-(-count // multiple) * multiple for count in counts]
        # row r of the padded layout is token source[r]'s hidden state, or the zero row that
        # follows the tokens (index T): one gather of the expert-sorted, padded input
        # sorted pair i (of expert e) goes to padded row i + (e's padded start - e's start)
        shift = [padded_start - start for padded_start, start in
                 zip(accumulate([0, *padded[:-1]]), accumulate([0, *counts[:-1]]), strict=True)]
        real = (torch.arange(chosen.numel(), device=hidden_states.device)
                + lean_grouped_fp8.upload(shift, torch.long, hidden_states.device)[
                    chosen[order]])
        pair_row, pair_of_row = pair_positions(order, real, sum(padded))
        x = DispatchRows.apply(hidden_states, pair_of_row, pair_row, top_k)
        hidden = self._experts_gemm(x, padded, self.gate_up_proj, 0)
        gate, up = hidden.chunk(2, dim=-1)
        out = self._experts_gemm(self.act_fn(gate) * up, padded, self.down_proj, 1)
        return CombineRows.apply(out, top_k_weights, pair_row, pair_of_row, hidden_states.dtype)

    def _experts_gemm(self, x: torch.Tensor, padded: list[int], weight: torch.Tensor,
                      part: int) -> torch.Tensor:
        """x's row blocks through the experts' slices of `weight` (part 0: gate_up, 1: down)."""
        experts = self.num_experts
        plan = lean_grouped_fp8.module_plan(self, part * experts, experts)
        if plan is not None and lean_grouped_fp8.applies(x, (weight,), padded):
            grad = torch.is_grad_enabled()
            return LeanGroupedFP8.apply(x, tuple(padded), plan, grad and x.requires_grad,
                                        grad and weight.requires_grad, weight)
        return self.run_gemms(x, padded, [weight[e] for e in range(experts)], [None] * experts,
                              gemms=list(range(part * experts, (part + 1) * experts)))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, gate_up_proj={list(self.gate_up_proj.shape)}, "
                f"down_proj={list(self.down_proj.shape)}, name={self.name!r}")


def offsets_casts(plans: list[LeanPlan | None]) -> OffsetsCasts | None:
    """The device-offsets path's casts when every expert GEMM of both parts has a lean plan of
    current scaling with one setting per operand (every expert and part alike), else None."""
    dtypes = uniform_dtypes(plans, delayed=False)
    if dtypes is None:
        return None
    settings = {(cast.amax_epsilon, cast.power_2_scale) for plan in plans
                for cast in (plan.input, plan.weight, plan.grad_output)}
    if len(settings) != 1:
        return None
    (amax_epsilon, power_2_scale), = settings
    return OffsetsCasts(*dtypes, amax_epsilon, power_2_scale)


def blocks_fit(blocks: OffsetsBlocks, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the block formats' blocks cut at experts and rows (grouped_offsets_blocks.py):
    MXFP8 needs K (and N for a gradient) in whole 32s, 2-D tiles N in whole 128s; on CUDA the
    grouped GEMM takes bf16 activations and weights."""
    _, n, k = weight.shape
    if x.is_cuda and not (x.dtype == weight.dtype == torch.bfloat16):
        return False
    if "mxfp8" in (blocks.input.kind, blocks.weight.kind) and k % 32:
        return False
    if blocks.grad_output.kind == "mxfp8" and n % 32:
        return False
    return n % blocks.weight.weight_rows_multiple() == 0


def fused_experts_layout(module: nn.Module) -> bool:
    """Whether `module` holds transformers' fused experts in the layout FusedExperts runs:
    gate_up_proj [E, 2F, D], down_proj [E, D, F], an act_fn, no biases."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not hasattr(module, "act_fn"):
        return False
    experts, double_ffn, hidden = gate_up.shape
    return (down.shape == (experts, hidden, double_ffn // 2) and double_ffn % 2 == 0
            and sum(1 for _ in module.parameters(recurse=False)) == 2)


@torch.no_grad()
def computes_like(original: nn.Module, converted: FusedExperts) -> bool:
    """Run both on a few random tokens outside autocast: the conversion holds only if the
    module computes what FusedExperts does (a model with interleaved gate/up halves, or
    another routine, would not)."""
    experts, _, hidden = converted.gate_up_proj.shape
    generator = torch.Generator().manual_seed(0)
    device, dtype = converted.gate_up_proj.device, converted.gate_up_proj.dtype
    tokens = torch.randn(8, hidden, generator=generator).to(device, dtype)
    top_k = min(2, experts)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k]
                         for _ in range(8)]).to(device)
    weights = torch.rand(8, top_k, generator=generator).to(device, dtype)
    want = original(tokens, index, weights)
    got = converted(tokens, index, weights)
    if want.shape != got.shape:
        return False
    # A relative error norm, not elementwise closeness: transformers may run its experts with
    # another kernel (grouped_mm on CUDA), whose bf16 sums round differently from these GEMMs
    # (an elementwise bf16 test refused every Mixtral expert on an H200); a layout that is not
    # FusedExperts' gives an error of order 1.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    error = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
    return bool(error < tolerance)
