"""End-to-end scores for the precision advisor: the whole model under a recipe spec against
high precision, and the choice of the GEMM that a finer format should take (`advise --finer`).

Why: advisor.py quantizes one operand of one GEMM at a time. That ranks operands, but it does not
say how a GEMM's error reaches what the optimizer consumes. On the tiny preset after 2000 bf16
steps (BENCHMARKS.md, thirty-second session) NVFP4 scored 22.1 / 21.9 / 20.8 dB per GEMM (fprop
/ dgrad / wgrad, both operands quantized): wgrad looked the worst. Yet the parameter gradient
of the whole model scored 5.3 dB against high precision with NVFP4 in the forward alone, and
17.2 dB with NVFP4 in the backward alone: a forward error passes through every later layer and
the loss, a backward error does not. Training agrees: NVFP4 forward only +3.5% val loss,
backward only +0.25% (CPU tiny, 2000 steps); +3.40% and +2.37% (H100 small, 1000 steps, two
seeds). So the end-to-end gradient decides which GEMM moves to the finer format.

The score, on the advisor's batches and weights:
- gradient SQNR: the gradient of all parameters (flattened) under the spec against the
  high-precision gradient of the same weights and batch, in dB, averaged over the batches. A
  recipe that rounds stochastically gets the mean gradient of `sr_draws` backward passes, as in
  advisor.SR_DRAWS: its noise averages out over the steps an optimizer sums, its bias does not.
- loss delta: the quantized forward's loss relative to the high-precision loss.
Delayed scaling is measured as current scaling of the same formats (advisor.measurable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recipes import CustomRecipe, HybridRecipe, NVFP4BlockScaling, Recipe
from .advisor import measurable, sqnr_db
from .recipe_specs import BASELINE, NAMED_RECIPES, parse_recipe

GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass
class EndToEndScore:
    spec: str
    gradient_sqnr_db: float  # mean over batches; higher is better
    loss_delta: float  # (quantized - high precision) / high precision, mean over batches
    finer_gemm: str = ""  # the GEMM this candidate runs in the finer format ("" for none)


def finer_candidates(recipe_spec: str, finer: str) -> list[tuple[str, str]]:
    """The three hybrids that move one GEMM of `recipe_spec` to `finer`: [(spec, gemm), ...].

    "nvfp4", "mxfp8" -> hybrid:mxfp8/nvfp4 (fprop), hybrid:nvfp4/mxfp8/nvfp4 (dgrad),
    hybrid:nvfp4/nvfp4/mxfp8 (wgrad); @-suffixes of the given spec are kept on each."""
    body, *suffixes = recipe_spec.strip().split("@")
    quantized = [name for name in NAMED_RECIPES if name != BASELINE]
    if body not in quantized:
        raise ValueError(f"--finer moves one GEMM of a named recipe to another format; "
                         f"--recipe {recipe_spec!r} is not one of {', '.join(quantized)} "
                         "(with optional @ suffixes)")
    if finer not in quantized:
        raise ValueError(f"--finer {finer!r} must name a quantized recipe, one of "
                         f"{', '.join(quantized)} (to keep a GEMM in high precision, use "
                         "--budget, or a hybrid with bf16 in compare)")
    if finer == body:
        raise ValueError(f"--finer {finer!r} is the recipe itself; name another format, e.g. "
                         "--recipe nvfp4 --finer mxfp8")
    tail = "".join("@" + suffix for suffix in suffixes)
    candidates = []
    for index, gemm in enumerate(GEMMS):
        parts = [body] * 3
        parts[index] = finer
        hybrid = (f"hybrid:{parts[0]}/{parts[1]}" if parts[1] == parts[2]
                  else "hybrid:" + "/".join(parts))
        candidates.append((hybrid + tail, gemm))
    return candidates


def _rounds_stochastically(recipe: Recipe) -> bool:
    """Whether a backward pass under the recipe draws random numbers (NVFP4's gradients);
    a recipe this cannot see into (a CustomRecipe) counts as drawing."""
    if isinstance(recipe, HybridRecipe):
        return any(sub is not None and _rounds_stochastically(sub)
                   for sub in (recipe.fprop, recipe.dgrad, recipe.wgrad))
    if isinstance(recipe, NVFP4BlockScaling):
        return not recipe.disable_stochastic_rounding
    return isinstance(recipe, CustomRecipe)


def _gradient(model: torch.nn.Module, recipe: Recipe | None, tokens: torch.Tensor, draws: int
              ) -> tuple[torch.Tensor, float]:
    """(all parameters' gradient flattened, mean over `draws` passes; the loss)."""
    from ..autocast import autocast

    total, loss_value = None, 0.0
    for _ in range(draws):
        model.zero_grad(set_to_none=True)
        with autocast(enabled=recipe is not None, recipe=recipe):
            loss = model.loss(tokens)
        loss.backward()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in model.parameters()]).double()
        total = flat if total is None else total + flat
        loss_value = float(loss.detach())
    model.zero_grad(set_to_none=True)
    return total / draws, loss_value


def end_to_end_scores(model: torch.nn.Module, batches: list[torch.Tensor],
                      specs: list[tuple[str, str]], n_layers: int, sr_draws: int
                      ) -> list[EndToEndScore]:
    """Score each (spec, finer GEMM) against the model's high-precision gradients and losses;
    the head stays in high precision as in compare (parse_recipe's default there)."""
    references = [_gradient(model, None, tokens, 1) for tokens in batches]
    scores = []
    for spec, gemm in specs:
        recipe = parse_recipe(spec, n_layers, head_in_high_precision=True)
        if recipe is None:
            raise ValueError("the end-to-end check needs a quantized recipe; bf16 is the "
                             "reference itself")
        recipe = measurable(recipe)
        draws = sr_draws if _rounds_stochastically(recipe) else 1
        decibels, deltas = [], []
        for tokens, (reference, reference_loss) in zip(batches, references, strict=True):
            gradient, loss = _gradient(model, recipe, tokens, draws)
            decibels.append(sqnr_db(reference, gradient))
            deltas.append((loss - reference_loss) / abs(reference_loss))
        scores.append(EndToEndScore(spec, sum(decibels) / len(decibels),
                                    sum(deltas) / len(deltas), gemm))
    return scores


def choose_finer(given: EndToEndScore, candidates: list[EndToEndScore]) -> EndToEndScore:
    """The candidate with the best gradient SQNR, or the given recipe if none improves it."""
    best = max(candidates, key=lambda score: score.gradient_sqnr_db)
    return best if best.gradient_sqnr_db > given.gradient_sqnr_db else given


def format_end_to_end(scores: list[EndToEndScore], finer: str | None) -> list[str]:
    """The end-to-end rows as a markdown table (lines)."""
    lines = ["whole model against high precision (same weights and batches)", "",
             "| spec | GEMM in " + (finer or "finer format") + " | gradient SQNR (dB) | "
             "loss delta |", "|---|---|---:|---:|"]
    for score in scores:
        lines.append(f"| {score.spec} | {score.finer_gemm or '-'} | "
                     f"{score.gradient_sqnr_db:.2f} | {score.loss_delta:+.3%} |")
    return lines
