"""benchmarks/cross_eval.py: trained models re-evaluated from their checkpoints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minifloat.lab import compare

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    generator = torch.Generator().manual_seed(1)
    words = ["def", "return", "self", "import", "for", "in", "if", "x", "(", ")", ":"]
    picks = torch.randint(0, len(words), (30_000,), generator=generator).tolist()
    path.write_text(" ".join(words[i] for i in picks))
    return path


def test_each_model_under_its_own_recipe_scores_what_compare_reported(tmp_path, corpus):
    out = tmp_path / "cmp"
    comparison = compare.run_comparison("bf16,nvfp4", 3, "tiny", out, seed=2,
                                        data_path=corpus, device="cpu", progress=False)
    reported = {run.label: run.final_val_loss for run in comparison.runs}
    table = _load("cross_eval").main(["--out", str(out), "--labels", "bf16,nvfp4", "--evals",
                                      "bf16,nvfp4", "--seed", "2", "--data", str(corpus)])
    assert table["bf16"][0] == reported["bf16"]
    assert table["nvfp4"][1] == reported["nvfp4"]
    # the other forward changes the loss: the NVFP4 forward is not the bf16 one
    assert table["bf16"][1] != table["bf16"][0]


def test_a_missing_run_names_the_checkpoint_it_looked_for(tmp_path, corpus):
    with pytest.raises(SystemExit, match="no checkpoint"):
        _load("cross_eval").main(["--out", str(tmp_path), "--labels", "bf16",
                                  "--data", str(corpus)])


@pytest.mark.parametrize("name, flag", [("no_sr", "disable_stochastic_rounding"),
                                        ("no_rht", "disable_rht"),
                                        ("no_2d", "disable_2d_quantization")])
def test_nvfp4_variants_turn_one_flag_off_and_keep_the_head(name, flag):
    recipe = getattr(_load("nvfp4_variants"), name)()
    assert recipe.high_precision == ("head",)
    for gemm in (recipe.fprop, recipe.dgrad, recipe.wgrad):
        flags = {f: getattr(gemm, f) for f in ("disable_stochastic_rounding", "disable_rht",
                                               "disable_2d_quantization")}
        assert flags == {f: f == flag for f in flags}
