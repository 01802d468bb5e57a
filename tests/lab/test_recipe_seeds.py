"""benchmarks/recipe_seeds.py: --deterministic reaches every worker's run, and only its run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from minifloat.lab import compare

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_recipe_seeds():
    spec = importlib.util.spec_from_file_location("recipe_seeds", BENCHMARKS / "recipe_seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("deterministic", [False, True])
def test_train_one_runs_under_the_asked_algorithms_and_restores_them(tmp_path, monkeypatch,
                                                                     deterministic):
    recipe_seeds = _load_recipe_seeds()
    seen = []
    original = compare.train_recipe

    def recording(plan, label, recipe, on_step=None):
        seen.append((plan.deterministic, torch.are_deterministic_algorithms_enabled()))
        return original(plan, label, recipe, on_step)

    monkeypatch.setattr(compare, "train_recipe", recording)
    before = torch.are_deterministic_algorithms_enabled()
    run = recipe_seeds.train_one("bf16", "tiny", 2, 0, str(tmp_path), "cpu", deterministic)
    assert seen == [(deterministic, deterministic)]
    assert torch.are_deterministic_algorithms_enabled() == before
    assert run.label == "bf16" and len(run.train_loss) == 2
    assert (tmp_path / "runs").is_dir() and len(list((tmp_path / "runs").glob("*.json"))) == 1


def test_the_flag_is_parsed_and_recorded(tmp_path, monkeypatch):
    recipe_seeds = _load_recipe_seeds()
    calls = {}

    def fake_train_all(specs, preset, steps, seed_list, out, device, jobs, deterministic=False):
        calls["train"] = deterministic
        return {}

    def fake_summarise(runs, specs, preset, steps, seed_list, out, device, jobs,
                       deterministic=False):
        calls["summary"] = deterministic
        (out / "seeds.txt").write_text("summary\n")
        return {"health_flags": [], "deterministic": deterministic}

    monkeypatch.setattr(recipe_seeds, "train_all", fake_train_all)
    monkeypatch.setattr(recipe_seeds, "summarise", fake_summarise)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored after the test
    assert recipe_seeds.main(["--preset", "tiny", "--steps", "2", "--seeds", "0",
                              "--recipes", "bf16", "--out", str(tmp_path),
                              "--deterministic"]) == 0
    assert calls == {"train": True, "summary": True}
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
