"""The precision advisor (lab/advisor.py, `python -m minifloat advise`) on the tiny preset."""

from __future__ import annotations

import torch

from minifloat.lab import advisor, cli
from minifloat.lab.advisor import DIRECTIONS, advise, propose, sqnr_db
from minifloat.lab.recipe_specs import parse_recipes
from minifloat.models.gpt import GPT, PRESETS
from minifloat.recipes import HybridRecipe, QuantizerRole

OUTLIER_LAYER = "blocks.1.mlp.fc1"


def _checkpoint(tmp_path, outlier: bool):
    """The tiny lab GPT's initial weights; with `outlier`, one input channel of OUTLIER_LAYER
    is made 200x larger (its fused norm's weight) and that channel's weights 200x smaller: the
    model computes the same function (as SmoothQuant's migration, in reverse), but the
    channel's outliers share scale blocks with the other channels' values."""
    torch.manual_seed(0)
    state = GPT(PRESETS["tiny"]).state_dict()
    if outlier:
        state["blocks.1.mlp.layer_norm_weight"][7] *= 200.0
        state["blocks.1.mlp.fc1_weight"][:, 7] /= 200.0
    path = tmp_path / ("outlier.pt" if outlier else "plain.pt")
    torch.save(state, path)
    return str(path)


def test_advisor_finds_a_planted_outlier_channel(tmp_path):
    planted = advise("tiny", "nvfp4", budget=0.2, batches=1,
                     checkpoint=_checkpoint(tmp_path, True))
    worst = min(planted.scores, key=lambda s: s.worst_db)
    assert (worst.layer, worst.tensor_type) == (OUTLIER_LAYER, "input")
    assert worst in planted.chosen and f"{OUTLIER_LAYER}:input" in planted.spec
    # the same model without the outlier: that operand is not the worst one, so the ranking
    # above came from the planted channel
    plain = advise("tiny", "nvfp4", budget=0.2, batches=1,
                   checkpoint=_checkpoint(tmp_path, False))
    plain_worst = min(plain.scores, key=lambda s: s.worst_db)
    assert (plain_worst.layer, plain_worst.tensor_type) != (OUTLIER_LAYER, "input")
    planted_score = next(s for s in planted.scores if s.pattern == f"{OUTLIER_LAYER}:input")
    plain_score = next(s for s in plain.scores if s.pattern == f"{OUTLIER_LAYER}:input")
    assert planted_score.sqnr_db["fprop"] < plain_score.sqnr_db["fprop"] - 3.0


def test_the_printed_spec_is_a_compare_spec_that_keeps_the_chosen_operands(tmp_path):
    advice = advise("tiny", "mxfp8", budget=0.1, batches=1)
    assert advice.chosen and advice.high_precision_share <= 0.1
    [(label, recipe)] = parse_recipes(advice.spec, PRESETS["tiny"].n_layers,
                                      head_in_high_precision=True)
    assert label == advice.spec and isinstance(recipe, HybridRecipe)
    for score in advice.chosen:
        assert recipe.keeps_high_precision(QuantizerRole("linear", score.tensor_type,
                                                         score.layer))
    assert recipe.keeps_high_precision(QuantizerRole("linear", "input", "head"))


def test_budget_accounting_counts_the_gemms_an_operand_moves():
    def score(layer, tensor_type, db, flops):
        return advisor.OperandScore(layer, tensor_type,
                                    {gemm: db for gemm, _ in DIRECTIONS[tensor_type]}, flops)

    scores = [score("a", "input", 5.0, 1.0), score("a", "weight", 6.0, 1.0),
              score("b", "grad_output", 7.0, 2.0), score("b", "input", 30.0, 2.0)]
    # total = 3 x (1 + 2) = 9; a:input moves fprop+wgrad of a (2), a:weight adds dgrad (1)
    chosen, share = propose(scores, budget=3 / 9)
    assert [s.pattern for s in chosen] == ["a:input", "a:weight"] and share == 3 / 9
    chosen, share = propose(scores, budget=0.0)
    assert chosen == [] and share == 0.0


def test_sqnr_never_rewards_a_nan():
    reference = torch.ones(4)
    assert sqnr_db(reference, reference) == advisor.SQNR_CAP_DB
    assert sqnr_db(reference, torch.tensor([1.0, float("nan"), 1.0, 1.0])) == float("-inf")


def test_cli_prints_table_and_spec_and_rejects_bad_input(capsys):
    assert cli.main(["advise", "--preset", "tiny", "--recipe", "fp8-current",
                     "--batches", "1", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "| layer | operand |" in out and "spec: fp8-current" in out
    assert cli.main(["advise", "--recipe", "bf16", "--batches", "1"]) == 2
    assert "nothing to advise" in capsys.readouterr().err
    assert cli.main(["advise", "--recipe", "nvfp4", "--budget", "2"]) == 2
    assert "budget" in capsys.readouterr().err


def test_nvfp4_specs_that_keep_one_wgrad_operand_in_high_precision_train(tmp_path):
    """Under NVFP4 both wgrad operands carry the RHT; an `@hp=` spec that keeps a layer's
    grad_output (what the advisor proposed for the small preset) or its input in high precision
    leaves one RHT operand against a plain one: the GEMM transforms the plain one too (an H200
    run of the advisor's spec raised here before). The advisor's own spec trains as well."""
    from minifloat.lab import compare

    advice = advise("tiny", "nvfp4", budget=0.1, batches=1)
    specs = ["nvfp4@hp=blocks.0.attn.qkv:grad_output", "nvfp4@hp=blocks.1.mlp.fc1:input",
             advice.spec]
    result = compare.run_comparison(",".join(specs), steps=2, preset="tiny",
                                    out_dir=tmp_path / "out", device="cpu", progress=False,
                                    val_batches=1)
    assert [run.label for run in result.runs] == specs
    for run in result.runs:
        assert len(run.train_loss) == 2 and all(map(torch.isfinite, map(torch.tensor,
                                                                       run.train_loss)))


def test_stochastically_rounded_copies_are_scored_by_their_mean_over_draws():
    """NVFP4's gradients are stochastically rounded: averaged over draws their noise shrinks
    (the score rises), while round-to-nearest copies (inputs, weights) score the same."""
    record = advisor.record_operands(advisor.lab_model("tiny", 0),
                                     advisor.advisor_batches("tiny", 1, 0))
    recipe = parse_recipes("nvfp4", PRESETS["tiny"].n_layers, head_in_high_precision=True)[0][1]
    torch.manual_seed(0)
    one = {s.pattern: s for s in advisor.score_operands(recipe, record, sr_draws=1)}
    torch.manual_seed(0)
    many = {s.pattern: s for s in advisor.score_operands(recipe, record, sr_draws=16)}
    gradients = [p for p in one if p.endswith(":grad_output")]
    forward = [p for p in one if not p.endswith(":grad_output")]
    assert gradients and forward
    for pattern in gradients:
        assert many[pattern].sqnr_db["wgrad"] > one[pattern].sqnr_db["wgrad"] + 3.0
    for pattern in forward:
        assert many[pattern].sqnr_db == one[pattern].sqnr_db
