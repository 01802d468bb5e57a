"""Val loss of a comparison's trained models evaluated under other forward recipes.

Why: a recipe's val-loss gap in `compare` mixes two effects: the weights it trained are worse,
and the validation forward itself runs quantized. Evaluating each trained model (the run's last
checkpoint in OUT/checkpoints/) in bf16 and under each recipe's forward separates them: the bf16
model under NVFP4 shows the cost of the quantized forward alone; the NVFP4 model in bf16 shows
what training in NVFP4 cost the weights (issue 19).

Usage: python benchmarks/cross_eval.py --out OUT --labels bf16,nvfp4 \\
           --evals bf16,nvfp4,mxfp8 [--preset tiny] [--seed 0] [--data PATH] [--device cpu]
OUT is a `python -m minifloat compare --out OUT` folder (same preset, seed and --data); the
validation batches are compare's (seed + 1), so a model evaluated under the recipe it trained
with scores the val loss compare reported for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minifloat.lab import compare  # noqa: E402
from minifloat.lab.recipe_specs import parse_recipe  # noqa: E402
from minifloat.lab.resume import checkpoint_path  # noqa: E402
from minifloat.models.gpt import GPT  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Prints the table; returns {trained label: [val loss under each of --evals]}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--labels", required=True, help="runs of OUT, comma-separated")
    parser.add_argument("--evals", default="bf16,nvfp4", help="forward recipes to evaluate in")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="compare's --data, if it was given")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    plan = compare.prepare_comparison("bf16", 1, args.preset, args.out, args.seed, args.data,
                                      args.device, None, None, compare.DEFAULT_VAL_BATCHES)
    validation = compare.validation_batches(plan)
    evals = args.evals.split(",")
    recipes = [parse_recipe(spec, plan.model.n_layers, head_in_high_precision=True)
               for spec in evals]
    table: dict[str, list[float]] = {}
    print(f"{'trained under':<24} {'step':>5} " + " ".join(f"{e:>22}" for e in evals))
    for label in args.labels.split(","):
        path = checkpoint_path(args.out, label)
        if not path.exists():
            raise SystemExit(f"no checkpoint {path}: run compare with --out {args.out} first")
        state = torch.load(path, weights_only=True)
        model = GPT(plan.model, dtype=plan.params_dtype, device=plan.device)
        model.load_state_dict(state["model"])
        losses = [compare.evaluate(model, validation, recipe) for recipe in recipes]
        print(f"{label:<24} {state['step']:>5} " + " ".join(f"{v:>22.4f}" for v in losses))
        table[label] = losses
    return table


if __name__ == "__main__":
    main()
