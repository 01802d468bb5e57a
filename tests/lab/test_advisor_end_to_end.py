"""The advisor's end-to-end scores and `advise --finer` (lab/advisor_end_to_end.py), tiny preset."""

from __future__ import annotations

import math

import pytest
import torch

from minifloat.autocast import autocast
from minifloat.lab import cli
from minifloat.lab.advisor import advise, advisor_batches, lab_model
from minifloat.lab.advisor_end_to_end import (
    EndToEndScore,
    choose_finer,
    end_to_end_scores,
    finer_candidates,
)
from minifloat.lab.recipe_specs import parse_recipe, parse_recipes
from minifloat.models.gpt import GPT, PRESETS
from minifloat.recipes import HybridRecipe, MXFP8BlockScaling, NVFP4BlockScaling

N_LAYERS = PRESETS["tiny"].n_layers


def test_finer_candidates_move_one_gemm_each_and_keep_the_suffixes():
    candidates = finer_candidates("nvfp4@last1", "mxfp8")
    assert [gemm for _, gemm in candidates] == ["fprop", "dgrad", "wgrad"]
    assert [spec for spec, _ in candidates] == [
        "hybrid:mxfp8/nvfp4@last1", "hybrid:nvfp4/mxfp8/nvfp4@last1",
        "hybrid:nvfp4/nvfp4/mxfp8@last1"]
    for spec, gemm in candidates:
        recipe = parse_recipe(spec, N_LAYERS, head_in_high_precision=True)
        assert isinstance(recipe, HybridRecipe)
        for other in ("fprop", "dgrad", "wgrad"):
            expected = MXFP8BlockScaling if other == gemm else NVFP4BlockScaling
            assert type(getattr(recipe, other)) is expected
        assert "blocks.1.*" in recipe.high_precision and "head" in recipe.high_precision


@pytest.mark.parametrize("recipe, finer, message", [
    ("hybrid:mxfp8/nvfp4", "fp8-current", "named recipe"),
    ("bf16", "mxfp8", "named recipe"),
    ("nvfp4", "bf16", "quantized recipe"),
    ("nvfp4", "fp16", "quantized recipe"),
    ("nvfp4", "nvfp4", "the recipe itself"),
])
def test_finer_rejects_what_it_cannot_split(recipe, finer, message):
    with pytest.raises(ValueError, match=message):
        finer_candidates(recipe, finer)


def _independent_gradient_sqnr_and_loss_delta(spec: str) -> tuple[float, float]:
    """torch.autograd.grad per parameter, sums of squares in float64 parameter by parameter."""
    model = lab_model("tiny", 0)
    (tokens,) = advisor_batches("tiny", 1, 0)
    parameters = list(model.parameters())
    reference_loss = model.loss(tokens)
    reference = torch.autograd.grad(reference_loss, parameters)
    with autocast(recipe=parse_recipe(spec, N_LAYERS, head_in_high_precision=True)):
        loss = model.loss(tokens)
    quantized = torch.autograd.grad(loss, parameters)
    signal = sum(float(r.double().pow(2).sum()) for r in reference)
    noise = sum(float((q.double() - r.double()).pow(2).sum())
                for q, r in zip(quantized, reference, strict=True))
    loss_value, reference_value = float(loss.detach()), float(reference_loss.detach())
    return (10 * math.log10(signal / noise),
            (loss_value - reference_value) / abs(reference_value))


@pytest.mark.parametrize("spec", ["mxfp8", "hybrid:fp8-current/mxfp8"])
def test_end_to_end_scores_equal_an_independent_computation(spec):
    model = lab_model("tiny", 0)
    [score] = end_to_end_scores(model, advisor_batches("tiny", 1, 0), [(spec, "")], N_LAYERS,
                                sr_draws=4)
    decibels, delta = _independent_gradient_sqnr_and_loss_delta(spec)
    assert score.gradient_sqnr_db == pytest.approx(decibels, abs=1e-6)
    assert score.loss_delta == pytest.approx(delta, rel=1e-9, abs=1e-12)
    assert 5.0 < score.gradient_sqnr_db < 60.0  # quantized, but not garbage


def test_stochastically_rounded_backwards_are_scored_by_their_mean_gradient():
    """NVFP4's gradients draw random numbers: with only the gradients quantized (weights and
    inputs kept), the mean of more backward passes is closer to high precision; a
    round-to-nearest recipe is measured once, whatever sr_draws says."""
    model = lab_model("tiny", 0)
    batches = advisor_batches("tiny", 1, 0)
    gradients_only = "hybrid:bf16/nvfp4@hp=*:weight+*:input"
    torch.manual_seed(0)
    [one] = end_to_end_scores(model, batches, [(gradients_only, "")], N_LAYERS, 1)
    [many] = end_to_end_scores(model, batches, [(gradients_only, "")], N_LAYERS, 16)
    assert many.gradient_sqnr_db > one.gradient_sqnr_db + 3.0
    assert one.loss_delta == many.loss_delta == 0.0  # the forward ran in high precision
    [rtn_one] = end_to_end_scores(model, batches, [("mxfp8", "")], N_LAYERS, 1)
    [rtn_many] = end_to_end_scores(model, batches, [("mxfp8", "")], N_LAYERS, 16)
    assert rtn_one.gradient_sqnr_db == rtn_many.gradient_sqnr_db


def _outlier_checkpoint(tmp_path) -> str:
    """tiny's initial weights with one input channel of blocks.1.mlp.fc1 200x larger and its
    weights 200x smaller (the same function; an outlier that NVFP4's forward blocks share)."""
    torch.manual_seed(0)
    state = GPT(PRESETS["tiny"]).state_dict()
    state["blocks.1.mlp.layer_norm_weight"][7] *= 200.0
    state["blocks.1.mlp.fc1_weight"][:, 7] /= 200.0
    path = tmp_path / "outlier.pt"
    torch.save(state, path)
    return str(path)


def test_finer_moves_the_gemm_whose_move_helps_the_gradient_most(tmp_path):
    """A planted forward outlier makes NVFP4's fprop the worst GEMM: --finer mxfp8 moves the
    forward; on the plain initial weights it moves another GEMM (the choice follows the
    measurement, it is not fixed)."""
    planted = advise("tiny", "nvfp4", batches=1, sr_draws=2, finer="mxfp8",
                     checkpoint=_outlier_checkpoint(tmp_path))
    given, *candidates = planted.end_to_end
    assert given.spec == "nvfp4" and [c.finer_gemm for c in candidates] == [
        "fprop", "dgrad", "wgrad"]
    best = max(candidates, key=lambda c: c.gradient_sqnr_db)
    assert best.finer_gemm == "fprop" and planted.recipe_spec == "hybrid:mxfp8/nvfp4"
    assert best.gradient_sqnr_db > given.gradient_sqnr_db + 3.0
    assert planted.spec.startswith("hybrid:mxfp8/nvfp4")
    [(label, recipe)] = parse_recipes(planted.spec, N_LAYERS, head_in_high_precision=True)
    assert label == planted.spec and type(recipe.fprop) is MXFP8BlockScaling
    assert type(recipe.dgrad) is type(recipe.wgrad) is NVFP4BlockScaling

    plain = advise("tiny", "nvfp4", batches=1, sr_draws=2, finer="mxfp8")
    assert plain.recipe_spec != "hybrid:mxfp8/nvfp4"
    assert plain.recipe_spec == max(plain.end_to_end[1:],
                                    key=lambda c: c.gradient_sqnr_db).spec


def test_choose_finer_keeps_the_recipe_when_no_move_improves_it():
    given = EndToEndScore("mxfp8", 30.0, 0.001)
    worse = [EndToEndScore("hybrid:fp8-current/mxfp8", 29.0, 0.0, "fprop"),
             EndToEndScore("hybrid:mxfp8/fp8-current/mxfp8", 30.0, 0.0, "dgrad")]
    assert choose_finer(given, worse) is given
    better = worse + [EndToEndScore("hybrid:mxfp8/mxfp8/fp8-current", 31.0, 0.0, "wgrad")]
    assert choose_finer(given, better) is better[-1]
    nan = EndToEndScore("hybrid:x", float("-inf"), float("nan"), "fprop")
    assert choose_finer(given, [nan]) is given  # a non-finite gradient never wins


def test_cli_finer_and_check_print_the_end_to_end_table(capsys):
    assert cli.main(["advise", "--recipe", "fp8-current", "--finer", "mxfp8", "--check",
                     "--batches", "1", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "| spec | GEMM in mxfp8 | gradient SQNR (dB) | loss delta |" in out
    assert "| fp8-current | - |" in out and "hybrid:mxfp8/fp8-current | fprop |" in out
    assert "--finer mxfp8:" in out and "\nspec: " in out
    spec = out.rsplit("spec: ", 1)[1].strip()
    assert f"| {spec} |" in out  # --check measured the proposed spec too
    assert cli.main(["advise", "--recipe", "nvfp4", "--finer", "bf16"]) == 2
    assert "quantized recipe" in capsys.readouterr().err
