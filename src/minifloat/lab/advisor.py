"""The precision advisor (`python -m minifloat advise`): which GEMM operands to keep in high
precision, measured, within a FLOP budget (issue 19).

Why: a recipe's loss gap usually comes from a few operands (an outlier channel in one layer's
input, the gradients of the last blocks), and keeping those in bf16 costs a small share of the
FLOPs. TransformerEngine, torchao and MS-AMP leave that choice to the user's guesses.

How:
1. The lab GPT runs a few batches in high precision under a CustomRecipe whose quantizers record
   every GEMM operand they are given (the input after any fused norm, the weight, the output
   gradient), per layer name: exactly what the recipe's quantizers would see.
2. For each operand and each GEMM it feeds (input: fprop rowwise and wgrad columnwise; weight:
   fprop rowwise and dgrad columnwise; output gradient: dgrad rowwise and wgrad columnwise), the
   operand alone is quantized with the quantizer the recipe gives that role and direction and
   dequantized, and the GEMM is computed with it and the other operand in high precision. The
   score is the SQNR (dB) of that GEMM's output (the layer output, the input gradient or the
   weight gradient) against the high-precision GEMM; an operand's score is its worse direction.
   A stochastically rounded copy counts as the mean of SR_DRAWS draws (its noise averages out
   over training steps; its bias does not).
3. Operands are taken worst first while the GEMMs they move to high precision stay within
   `budget` of the quantized layers' GEMM FLOPs (keeping an operand in high precision runs the
   two GEMMs it feeds in high precision). The LM head is not a candidate: `compare` keeps it in
   high precision already.
The proposal is a recipe spec, `RECIPE@hp=LAYER:OPERAND+...`, that `compare --recipes` takes as
printed. Delayed scaling is measured as current scaling of the same formats (its scales are
history, not a property of these batches).

`finer=` (`--finer NAME`) first lets one GEMM use a finer format, chosen end to end (whole-model
gradient against high precision, advisor_end_to_end.py), and scores the operands under that
hybrid; `check=` measures the given recipe and the proposal end to end too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..models.gpt import GPT, PRESETS
from ..quantizers import HybridQuantizer, IdentityQuantizer, Quantizer
from ..recipe_state import RecipeState
from ..recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8CurrentScaling,
    HybridRecipe,
    QuantizerRole,
    Recipe,
)
from .data import load_corpus, sample_batch
from .recipe_specs import HEAD_LAYER, parse_recipe

if TYPE_CHECKING:
    from .advisor_end_to_end import EndToEndScore

# tensor_type -> ((GEMM, columnwise), (GEMM, columnwise)) for the two copies of an operand
DIRECTIONS = {"input": (("fprop", False), ("wgrad", True)),
              "weight": (("fprop", False), ("dgrad", True)),
              "grad_output": (("dgrad", False), ("wgrad", True))}
SQNR_CAP_DB = 200.0  # an exact copy (e.g. a slot the recipe keeps in high precision)
# A stochastically rounded copy (NVFP4's gradients) is unbiased: its rounding noise is new at
# every step and averages out over the steps an optimizer sums, which one draw's SQNR does not
# show (on the small preset every NVFP4 grad_output scored 16-18 dB in wgrad on one draw, worst
# of all operands, and keeping six of them in bf16 moved the loss gap not at all: +6.6% against
# +6.3%, BENCHMARKS.md). Such a copy is scored as the mean of this many draws: what remains of
# its error over that many steps, its bias in full and its noise divided by the draws.
SR_DRAWS = 8


class OperandRecord:
    """What the recording quantizers saw, by (layer name, tensor type)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], list[torch.Tensor]] = {}
        self.module_types: dict[str, str] = {}


class RecordingQuantizer(IdentityQuantizer):
    """Keeps values as they are and records them (weights: the last one only)."""

    def __init__(self, role: QuantizerRole, record: OperandRecord) -> None:
        super().__init__()
        self.key, self.record = (role.name, role.tensor_type), record
        record.module_types[role.name] = role.module_type

    def _quantize_impl(self, x: torch.Tensor, owner: Quantizer):
        values = x.detach().reshape(-1, x.shape[-1]).float().clone()
        seen = self.record.seen.setdefault(self.key, [])
        if self.key[1] == "weight":
            seen.clear()
        seen.append(values)
        return super()._quantize_impl(x, owner)


class _Recording:
    """The CustomRecipe factory: a recording quantizer for every slot of a named layer."""

    def __init__(self, record: OperandRecord) -> None:
        self.record = record

    def __call__(self, role: QuantizerRole) -> Quantizer:
        if not role.name:
            return IdentityQuantizer()
        return RecordingQuantizer(role, self.record)


@dataclass
class OperandScore:
    layer: str
    tensor_type: str
    sqnr_db: dict[str, float]  # GEMM -> SQNR of its output with this operand quantized
    gemm_flops: float  # one GEMM of this layer (2 M N K)

    @property
    def worst_db(self) -> float:
        return min(self.sqnr_db.values())

    @property
    def pattern(self) -> str:
        return f"{self.layer}:{self.tensor_type}"


@dataclass
class Advice:
    recipe_spec: str
    budget: float
    scores: list[OperandScore]
    chosen: list[OperandScore] = field(default_factory=list)
    high_precision_share: float = 0.0
    end_to_end: list[EndToEndScore] = field(default_factory=list)
    finer: str | None = None  # the format one GEMM was offered (advise --finer)

    @property
    def spec(self) -> str:
        if not self.chosen:
            return self.recipe_spec
        return self.recipe_spec + "@hp=" + "+".join(score.pattern for score in self.chosen)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - approx|^2), capped for an exact copy; -inf for a non-finite
    approximation (a NaN is the worst score, never a good one)."""
    if not torch.isfinite(approximation).all():
        return -math.inf
    noise = (reference - approximation).double().pow(2).sum().item()
    signal = reference.double().pow(2).sum().item()
    if noise == 0.0:
        return SQNR_CAP_DB
    return min(10.0 * math.log10(max(signal, 1e-300) / noise), SQNR_CAP_DB)


def measurable(recipe: Recipe) -> Recipe:
    """The recipe with delayed scaling replaced by current scaling of the same formats (in a
    hybrid's GEMMs too): a delayed scale is history, not a property of the advisor's batches."""
    if isinstance(recipe, DelayedScaling):
        return Float8CurrentScaling(fp8_format=recipe.fp8_format)
    if isinstance(recipe, HybridRecipe):
        return dataclasses.replace(recipe, **{
            gemm: None if getattr(recipe, gemm) is None else measurable(getattr(recipe, gemm))
            for gemm in ("fprop", "dgrad", "wgrad")})
    return recipe


def _quantized(recipe: Recipe, role: QuantizerRole, values: torch.Tensor, columnwise: bool,
               sr_draws: int = 1) -> torch.Tensor:
    """values through the recipe's quantizer of `role`, one direction, decoded again; for a
    quantizer with stochastic rounding, the mean of `sr_draws` independent draws."""
    mode = "backward" if role.tensor_type == "grad_output" else "forward"
    quantizer = RecipeState.create(recipe, mode, roles=[role]).make_quantizers()[0]
    quantizer.set_usage(rowwise=not columnwise, columnwise=columnwise)
    quantizer.internal = True
    if not quantizer.is_quantizable(values):
        raise ValueError(f"{role.name} {role.tensor_type} {tuple(values.shape)} does not fit "
                         f"the recipe's block sizes; use more batches or another preset")
    child = quantizer
    if isinstance(quantizer, HybridQuantizer):  # a recipe with @hp= operands: per direction
        child = quantizer.columnwise_quantizer if columnwise else quantizer.rowwise_quantizer
    draws = sr_draws if getattr(child, "stochastic_rounding", False) else 1
    decoded = quantizer(values).dequantize(torch.float32)
    for _ in range(draws - 1):
        decoded += quantizer(values).dequantize(torch.float32)
    return decoded / draws if draws > 1 else decoded


def _gemm(name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    if name == "fprop":
        return x @ w.t()
    if name == "dgrad":
        return dy @ w
    return dy.t() @ x


def score_operands(recipe: Recipe, record: OperandRecord, sr_draws: int = SR_DRAWS
                   ) -> list[OperandScore]:
    """Every recorded operand of every named GEMM but the head, with its SQNR per GEMM
    (stochastically rounded copies: of the mean of `sr_draws` draws, see SR_DRAWS)."""
    recipe = measurable(recipe)
    scores = []
    layers = sorted({layer for layer, _ in record.seen if layer != HEAD_LAYER})
    for layer in layers:
        try:
            x = torch.cat(record.seen[(layer, "input")])
            (w,) = record.seen[(layer, "weight")]
            dy = torch.cat(record.seen[(layer, "grad_output")])
        except KeyError:
            continue  # a slot that never quantized (e.g. no backward): nothing to score
        if x.shape[0] != dy.shape[0]:
            raise RuntimeError(f"{layer}: {x.shape[0]} input rows but {dy.shape[0]} gradient "
                               "rows were recorded; the advisor needs one backward per forward")
        operands = {"input": x, "weight": w, "grad_output": dy}
        references = {gemm: _gemm(gemm, x, w, dy) for gemm in ("fprop", "dgrad", "wgrad")}
        flops = 2.0 * x.shape[0] * w.shape[0] * w.shape[1]
        for tensor_type, directions in DIRECTIONS.items():
            role = QuantizerRole(record.module_types[layer], tensor_type, layer)
            result = {}
            for gemm, columnwise in directions:
                swapped = dict(operands)
                swapped[tensor_type] = _quantized(recipe, role, operands[tensor_type],
                                                  columnwise, sr_draws)
                approx = _gemm(gemm, swapped["input"], swapped["weight"],
                               swapped["grad_output"])
                result[gemm] = sqnr_db(references[gemm], approx)
            scores.append(OperandScore(layer, tensor_type, result, flops))
    return scores


def propose(scores: list[OperandScore], budget: float) -> tuple[list[OperandScore], float]:
    """Worst operands first, while the GEMMs they move to high precision fit the budget
    (a share of all scored layers' GEMM FLOPs); (chosen, the share they use)."""
    total = sum(3 * flops for flops in {s.layer: s.gemm_flops for s in scores}.values())
    if total == 0:
        return [], 0.0
    high: dict[str, set[str]] = {}
    chosen, used = [], 0.0
    for score in sorted(scores, key=lambda s: s.worst_db):
        if score.worst_db >= SQNR_CAP_DB:
            break  # already exact: nothing to gain
        gemms = high.get(score.layer, set()) | {g for g, _ in DIRECTIONS[score.tensor_type]}
        added = (len(gemms) - len(high.get(score.layer, set()))) * score.gemm_flops
        if (used + added) / total > budget + 1e-12:
            continue
        high[score.layer] = gemms
        used += added
        chosen.append(score)
    return chosen, used / total


def _require_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")


def lab_model(preset: str, seed: int, checkpoint: str | None = None, device: str = "cpu"
              ) -> GPT:
    """The preset's lab GPT in fp32: seed's initial weights, or a checkpoint's."""
    _require_preset(preset)
    torch.manual_seed(seed)
    model = GPT(PRESETS[preset], dtype=torch.float32, device=device)
    if checkpoint is not None:
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state.get("model", state) if isinstance(state, dict) else state)
    return model


def advisor_batches(preset: str, batches: int, seed: int, data: str | None = None,
                    device: str = "cpu") -> list[torch.Tensor]:
    """The token batches every measurement of one advice uses (seed's draw of the corpus)."""
    config = PRESETS[preset]
    corpus = load_corpus(data)
    generator = torch.Generator().manual_seed(seed)
    return [sample_batch(corpus.train, config.batch_size, config.seq_len, generator).to(device)
            for _ in range(batches)]


def record_operands(model: GPT, batches: list[torch.Tensor]) -> OperandRecord:
    """Run a forward+backward pass per batch in high precision, recording every operand."""
    from ..autocast import autocast

    record = OperandRecord()
    recipe = CustomRecipe(qfactory=_Recording(record))
    for tokens in batches:
        with autocast(recipe=recipe):
            loss = model.loss(tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return record


def advise(preset: str, recipe_spec: str, budget: float = 0.1, batches: int = 2, seed: int = 0,
           data: str | None = None, checkpoint: str | None = None,
           record: OperandRecord | None = None, device: str = "cpu",
           sr_draws: int = SR_DRAWS, finer: str | None = None, check: bool = False) -> Advice:
    """Score every operand of the preset's model under the recipe and propose a spec (on
    `device`: the recorded operands stay where the model ran).

    finer: a named recipe that one GEMM may use instead (advisor_end_to_end.py): the three
    hybrids that move one GEMM to it are measured end to end, and the best one, if it beats the
    recipe as given, becomes the recipe the operands are scored under. check: also measure the
    given recipe and the proposed spec end to end."""
    from .advisor_end_to_end import choose_finer, end_to_end_scores, finer_candidates

    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"--budget is a share of GEMM FLOPs in [0, 1], got {budget}")
    if sr_draws < 1:
        raise ValueError(f"--sr-draws must be at least 1, got {sr_draws}")
    _require_preset(preset)
    n_layers = PRESETS[preset].n_layers
    if parse_recipe(recipe_spec, n_layers, head_in_high_precision=True) is None:
        raise ValueError("the advisor needs a quantized recipe; bf16 has nothing to advise")
    candidates = finer_candidates(recipe_spec, finer) if finer is not None else []
    model = lab_model(preset, seed, checkpoint, device)
    tokens = advisor_batches(preset, batches, seed, data, device)
    end_to_end = []
    if candidates or check:
        end_to_end = end_to_end_scores(model, tokens, [(recipe_spec, "")] + candidates,
                                       n_layers, sr_draws)
    scored_spec = recipe_spec
    if candidates:
        scored_spec = choose_finer(end_to_end[0], end_to_end[1:]).spec
    if record is None:
        record = record_operands(model, tokens)
    recipe = parse_recipe(scored_spec, n_layers, head_in_high_precision=True)
    scores = score_operands(recipe, record, sr_draws)
    chosen, share = propose(scores, budget)
    advice = Advice(scored_spec, budget, scores, chosen, share, end_to_end, finer)
    if check and advice.spec not in {score.spec for score in end_to_end}:
        advice.end_to_end += end_to_end_scores(model, tokens, [(advice.spec, "")], n_layers,
                                               sr_draws)
    return advice


def format_advice(advice: Advice, rows: int = 20) -> str:
    """The end-to-end rows (if measured), the worst operands as a table, then the spec."""
    from .advisor_end_to_end import format_end_to_end

    lines = []
    if advice.end_to_end:
        lines += format_end_to_end(advice.end_to_end, advice.finer) + [""]
    if advice.finer is not None:
        moved = advice.recipe_spec != advice.end_to_end[0].spec
        lines += [f"--finer {advice.finer}: " + (
            f"{advice.recipe_spec} moves one GEMM to {advice.finer} (best gradient SQNR); "
            "the operands below are scored under it" if moved else
            f"no GEMM in {advice.finer} improved the gradient SQNR; the recipe stays as given"),
            ""]
    lines += [f"operand SQNR under {advice.recipe_spec} (dB, higher is better; each operand "
             "quantized alone, the GEMM against high precision)", "",
             "| layer | operand | fprop | dgrad | wgrad | kept |", "|---|---|---:|---:|---:|---|"]
    chosen = {id(score) for score in advice.chosen}
    for score in sorted(advice.scores, key=lambda s: s.worst_db)[:rows]:
        cells = [f"{score.sqnr_db[g]:.1f}" if g in score.sqnr_db else ""
                 for g in ("fprop", "dgrad", "wgrad")]
        lines.append(f"| {score.layer} | {score.tensor_type} | " + " | ".join(cells)
                     + f" | {'high precision' if id(score) in chosen else ''} |")
    lines += ["", f"{len(advice.chosen)} operands in high precision: "
              f"{advice.high_precision_share:.1%} of the GEMM FLOPs (budget "
              f"{advice.budget:.0%})", "", f"spec: {advice.spec}"]
    return "\n".join(lines)
