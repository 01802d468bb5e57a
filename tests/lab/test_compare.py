"""`python -m minifloat compare`: a smoke run, determinism, and errors before any training."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys

import pytest
import torch

from minifloat.lab import cli, compare

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
FILES = ("table.txt", "results.json", "results.csv", "curves.csv")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A small text corpus (faster to load than the stdlib default)."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    generator = torch.Generator().manual_seed(0)
    words = ["def", "return", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")"]
    picks = torch.randint(0, len(words), (40_000,), generator=generator).tolist()
    path.write_text(" ".join(words[i] for i in picks))
    return path


@pytest.fixture
def user_recipe(tmp_path):
    path = tmp_path / "user_recipe.py"
    path.write_text("import minifloat as mf\n\n"
                    "def fwd_only():\n"
                    "    return mf.HybridRecipe(mf.Float8BlockScaling(), None, None)\n")
    return path


def test_cli_smoke_run_writes_table_json_csv_png(tmp_path, data_file, user_recipe, capsys):
    out = tmp_path / "out"
    recipes = f"bf16,fp8-delayed,hybrid:mxfp8/nvfp4@last1,{user_recipe}:fwd_only"
    status = cli.main(["compare", "--recipes", recipes, "--steps", "3", "--out", str(out),
                       "--data", str(data_file), "--val-batches", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    labels = recipes.split(",")
    assert "gap to bf16" in captured.out and "tokens/s" in captured.out
    for label in labels:
        assert label in captured.out
    assert "baseline" in captured.out
    for name in FILES:
        assert (out / name).is_file()
    assert (out / "table.txt").read_text().strip() in captured.out

    results = json.loads((out / "results.json").read_text())
    assert results["config"]["steps"] == 3 and results["baseline"] == "bf16"
    assert [run["label"] for run in results["runs"]] == labels
    for run in results["runs"]:
        assert len(run["train_loss"]) == 3
        assert run["val_loss"][-1][0] == 3
        assert run["summary"]["tokens_per_second"] > 0
    assert results["runs"][0]["summary"]["gap_to_bf16_percent"] == 0.0

    with (out / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["recipe"] for row in rows] == labels
    assert float(rows[1]["final_val_loss"]) == pytest.approx(
        results["runs"][1]["summary"]["final_val_loss"])
    with (out / "curves.csv").open() as handle:
        curves = list(csv.DictReader(handle))
    assert len(curves) == 3 * len(labels)

    if HAS_MATPLOTLIB:
        assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib" in captured.err


def _losses(tmp_path, recipes, seed=0, name="run"):
    result = compare.run_comparison(recipes, steps=3, out_dir=tmp_path / name, seed=seed,
                                    data_path=None, device="cpu", progress=False,
                                    val_batches=2)
    return {run.label: (run.train_loss, run.val_loss) for run in result.runs}


def test_same_seed_same_losses_bitwise(tmp_path):
    first = _losses(tmp_path, "bf16,nvfp4", name="a")  # nvfp4: stochastic rounding too
    second = _losses(tmp_path, "bf16,nvfp4", name="b")
    assert first == second
    assert first["bf16"][0] != first["nvfp4"][0]  # the recipe changes the losses
    assert first["bf16"][0][0] != _losses(tmp_path, "bf16", seed=1, name="c")["bf16"][0][0]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a model is built or a recipe trained."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        raise AssertionError("training started despite a bad argument")

    monkeypatch.setattr(compare, "train_recipe", spy)
    monkeypatch.setattr(compare, "GPT", spy)
    return calls


def _run_bad(args, capsys):
    status = cli.main(["compare", "--steps", "2", *args])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("args, fragment", [
    (["--recipes", "bf16,fp9"], "unknown recipe 'fp9'"),
    (["--recipes", "bf16,hybrid:mxfp8/nvfp5"], "unknown recipe 'nvfp5'"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--steps", "-1"], "--steps: must be >= 1, got -1"),
    (["--steps", "abc"], "--steps: must be a whole number of steps >= 1, got 'abc'"),
    (["--steps", "1.5"], "--steps: must be a whole number"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--data", "/no/such/corpus"], "--data /no/such/corpus: no such file or folder"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--seed", "-3"], "--seed must be an integer >= 0"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_exit_2_before_training(args, fragment, tmp_path, capsys, no_training):
    status, err = _run_bad([*args, "--out", str(tmp_path / "out")], capsys)
    assert status == 2
    assert "error:" in err and fragment in err
    assert "Traceback" not in err
    assert not no_training


def test_out_under_a_file_is_rejected(tmp_path, capsys, no_training):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "sub"):
        status, err = _run_bad(["--recipes", "bf16", "--out", str(out)], capsys)
        assert status == 2 and f"--out {out}" in err, err
    assert not no_training


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_read_only_out_is_rejected(tmp_path, capsys, no_training):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        status, err = _run_bad(["--recipes", "bf16", "--out", str(locked)], capsys)
    finally:
        locked.chmod(0o700)
    assert status == 2 and "cannot write there" in err
    assert not no_training


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_a_gpu_is_rejected(tmp_path, capsys, no_training):
    status, err = _run_bad(["--device", "cuda", "--out", str(tmp_path / "o")], capsys)
    assert status == 2 and "no CUDA device" in err


def test_recipes_help_exits_0(capsys, no_training):
    assert cli.main(["compare", "--recipes", "help"]) == 0
    out = capsys.readouterr().out
    assert "hybrid:FWD/BWD" in out and "nvfp4" in out and "module:function" in out


def test_without_matplotlib_and_tqdm(tmp_path, data_file, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm", None)
    out = tmp_path / "out"
    status = cli.main(["compare", "--recipes", "bf16", "--steps", "1", "--out", str(out),
                       "--data", str(data_file), "--val-batches", "1", "--device", "cpu"])
    captured = capsys.readouterr()
    assert status == 0
    assert "loss_curves.png skipped: matplotlib is not installed" in captured.err
    assert "pip install" in captured.err and "step 1/1" in captured.err
    assert not (out / "loss_curves.png").exists()
    assert all((out / name).is_file() for name in FILES)
    bf16_row = next(line for line in captured.out.splitlines() if line.startswith("bf16"))
    assert "baseline" in bf16_row


def test_gap_column_without_bf16(tmp_path, data_file, capsys):
    status = cli.main(["compare", "--recipes", "mxfp8", "--steps", "1", "--out",
                       str(tmp_path / "o"), "--data", str(data_file), "--val-batches", "1",
                       "--no-progress", "--device", "cpu"])
    assert status == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("mxfp8"))
    assert "—" in row


def test_formats_command_still_there(capsys):
    assert cli.main(["formats", "--rows", "128", "--cols", "128"]) == 0
    assert "MXFP8" in capsys.readouterr().out


def test_table_and_json_say_which_layers_ran_in_high_precision(tmp_path, data_file):
    result = compare.run_comparison("bf16,fp8-current,fp8-current@quantize-head", steps=1,
                                    out_dir=tmp_path, data_path=data_file, device="cpu",
                                    progress=False, val_batches=1)
    from minifloat.lab import report

    results = report.results_dict(result)
    kept = {run["label"]: run["high_precision"] for run in results["runs"]}
    assert kept == {"bf16": [], "fp8-current": ["head"], "fp8-current@quantize-head": []}
    table = report.format_table(result)
    assert "high precision" in table and "head" in table


def test_seeds_give_mean_spread_and_noise_marks(tmp_path, data_file, capsys):
    """--seeds 0,1: a comparison per seed in its folder, then the summary: per recipe the mean
    and spread of the final val loss over the seeds, the gap of means to bf16, and the mark
    "within noise" exactly when the gap is below bf16's own spread and the recipe is not worse
    (or better) than the same-seed bf16 run in every seed."""
    code = cli.main(["compare", "--recipes", "bf16,fp8-current", "--steps", "2", "--seeds",
                     "0,1", "--out", str(tmp_path), "--data", str(data_file), "--device", "cpu",
                     "--no-progress", "--val-batches", "1"])
    assert code == 0
    for seed in (0, 1):
        assert (tmp_path / f"seed{seed}" / "results.json").exists()
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert summary["seeds"] == [0, 1]
    per_seed = [json.loads((tmp_path / f"seed{seed}" / "results.json").read_text())
                for seed in (0, 1)]
    finals = {run["label"]: [r["runs"][i]["summary"]["final_val_loss"] for r in per_seed]
              for i, run in enumerate(per_seed[0]["runs"])}
    for label, values in finals.items():
        row = summary["recipes"][label]
        assert row["mean"] == pytest.approx(sum(values) / 2)
        assert (row["min"], row["max"]) == (min(values), max(values))
    spread = (max(finals["bf16"]) - min(finals["bf16"])) / (sum(finals["bf16"]) / 2) * 100
    gap = summary["recipes"]["fp8-current"]["gap_percent"]
    pairs = list(zip(finals["fp8-current"], finals["bf16"], strict=True))
    paired_signs = {v > b for v, b in pairs}
    assert summary["recipes"]["fp8-current"]["within_noise"] == (
        abs(gap) < spread and len(paired_signs) > 1)
    # paired gaps: each seed against the bf16 run of that seed
    paired = [(v / b - 1) * 100 for v, b in pairs]
    assert summary["recipes"]["fp8-current"]["paired_gaps_percent"] == pytest.approx(paired)
    assert summary["recipes"]["fp8-current"]["paired_gap_mean"] == pytest.approx(sum(paired) / 2)
    row = next(line for line in (tmp_path / "seeds.txt").read_text().splitlines()
               if line.startswith("fp8-current "))
    assert ("within noise" in row) == summary["recipes"]["fp8-current"]["within_noise"]


def test_seeds_noise_rule_uses_the_same_seed_gaps():
    """A recipe inside bf16's seed-to-seed spread but worse than the same-seed bf16 run in every
    seed is not within noise (NVFP4's case on an H100); one with mixed signs is."""
    from types import SimpleNamespace

    from minifloat.lab.seeds import format_summary, summarise

    finals = {"bf16": [0.80, 0.85, 0.79], "steady": [0.82, 0.87, 0.81],
              "mixed": [0.81, 0.84, 0.80]}
    comparisons = [SimpleNamespace(plan=SimpleNamespace(seed=seed), runs=[
        SimpleNamespace(label=label, final_val_loss=values[seed])
        for label, values in finals.items()]) for seed in range(3)]
    summary = summarise(comparisons)
    steady, mixed = summary["recipes"]["steady"], summary["recipes"]["mixed"]
    assert abs(steady["gap_percent"]) < summary["bf16_spread_percent"]
    assert steady["paired_verdict"] == "worse in every seed" and not steady["within_noise"]
    assert mixed["paired_verdict"] == "mixed" and mixed["within_noise"]
    assert steady["paired_gaps_percent"] == pytest.approx([2.5, 100 * (0.87 / 0.85 - 1),
                                                           100 * (0.81 / 0.79 - 1)])
    assert "worse in every seed" in format_summary(summary)


def test_seeds_reject_bad_lists(tmp_path, capsys, no_training):
    for text in ("1", "0,0", "a,b"):
        assert cli.main(["compare", "--seeds", text, "--out", str(tmp_path)]) == 2
        assert "--seeds" in capsys.readouterr().err


def test_deterministic_runs_say_what_they_cost(tmp_path, data_file):
    """--deterministic turns torch's deterministic algorithms on for the comparison only, and
    the table and results.json give the measured cost (bf16 step time with over without)."""
    from minifloat.lab import report

    before = torch.are_deterministic_algorithms_enabled()
    result = compare.run_comparison("bf16,fp8-current", steps=2, out_dir=tmp_path,
                                    data_path=data_file, device="cpu", progress=False,
                                    val_batches=1, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert result.deterministic_cost is not None and result.deterministic_cost > 0
    assert "deterministic algorithms on" in report.format_table(result)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["deterministic"] is True
    assert saved["deterministic_cost"] == pytest.approx(result.deterministic_cost)


def test_an_interrupted_comparison_resumes_bitwise(tmp_path, data_file, monkeypatch):
    """Each run checkpoints after every evaluation; started again over the same folder, an
    interrupted comparison picks its runs up at their last checkpoint and ends with the
    uninterrupted curves bit for bit (delayed scaling's histories and NVFP4's stochastic
    rounding, which draws from the global RNG, included)."""
    recipes = "bf16,fp8-delayed@quantize-head,nvfp4"
    options = dict(steps=6, eval_every=2, data_path=data_file, device="cpu", progress=False,
                   val_batches=1)
    whole = compare.run_comparison(recipes, out_dir=tmp_path / "whole", **options)

    calls = {"count": 0}
    original = compare._Progress.__call__

    def interrupt(self, step, loss):  # stop inside the second recipe, after its step 4
        calls["count"] += 1
        if calls["count"] == 6 + 5:
            raise KeyboardInterrupt
        return original(self, step, loss)

    monkeypatch.setattr(compare._Progress, "__call__", interrupt)
    with pytest.raises(KeyboardInterrupt):
        compare.run_comparison(recipes, out_dir=tmp_path / "resumed", **options)
    trained = []

    def count(self, step, loss):
        trained.append(step)
        return original(self, step, loss)

    monkeypatch.setattr(compare._Progress, "__call__", count)
    resumed = compare.run_comparison(recipes, out_dir=tmp_path / "resumed", **options)
    # bf16 had finished (nothing to train), fp8-delayed resumed after step 4, nvfp4 ran whole
    assert trained == [5, 6, 1, 2, 3, 4, 5, 6]
    for a, b in zip(whole.runs, resumed.runs, strict=True):
        assert a.label == b.label
        assert a.train_loss == b.train_loss, a.label
        assert a.val_loss == b.val_loss, a.label


def test_each_preset_has_its_own_default_learning_rate(tmp_path, data_file):
    """--lr left out takes the preset's rate (PRESET_LR: from the recorded sweeps); given, it
    wins."""
    for preset, want in (("tiny", 3e-3), ("small", 1e-3), ("1b", 1e-3)):
        plan = compare.prepare_comparison("bf16", 1, preset, tmp_path / preset,
                                          data_path=data_file)
        assert plan.lr == want == compare.PRESET_LR[preset]
    plan = compare.prepare_comparison("bf16", 1, "small", tmp_path / "given", lr=5e-4,
                                      data_path=data_file)
    assert plan.lr == 5e-4
