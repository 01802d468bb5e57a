"""Recipes over several seeds with one process per (recipe, seed), all in parallel: issue 19's
comparison (the `small` preset, 2000 steps, 3 seeds) within one device call.

Why beside `python -m minifloat compare --seeds`: that trains every run in one process, one
after the other, and the `small` preset is host-bound (its eager step keeps the GPU mostly idle),
so 21 runs of 2000 steps take about an hour there; run side by side they share the GPU and the
host's cores. Every run is what `compare` trains (compare.train_recipe on a plan of that one
recipe and seed: the same model, data, schedule and recipe spec), and the summary is
compare's own: per seed a table, results and curves (the seed{N} folders, lab.report), over the
seeds each recipe's mean and spread with gaps inside the bf16 runs' spread marked as noise
(seeds.txt, seeds.json, seeds.png; lab.seeds), and the health flags (plateau, spike, NaN) of
every run (lab.health). Runs on one GPU interfere in speed, not in results: the tokens/s of
this script mean nothing; the losses are those of separate runs.

Usage:
  python benchmarks/recipe_seeds.py --preset small --steps 2000 --seeds 0,1,2 \\
      --recipes bf16,fp8-current,fp8-delayed,fp8-block,mxfp8,nvfp4 [--jobs 16] \\
      [--device cuda] --out DIR
Recipe specs as `compare --recipes` takes them ('help' lists them), separated by commas. Add
`bf16-nudged` (bf16 with its initial weights nudged by one bf16 step, lab.noise_control) to
measure how far a same-seed gap moves by chance: it costs one bf16 run per seed.
--deterministic trains every run with torch's deterministic algorithms where they exist (as
`compare --deterministic` does), to tell the kernels' run-to-run differences apart from the
chaos the control measures; what that costs in speed, `compare --deterministic` reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minifloat.lab import compare, seeds  # noqa: E402
from minifloat.lab.health import loss_flags  # noqa: E402
from minifloat.lab.report import write_reports  # noqa: E402


def _plan(specs: str, preset: str, steps: int, seed: int, out: Path, device: str,
          deterministic: bool = False) -> compare.Plan:
    return compare.prepare_comparison(specs, steps, preset, out / f"seed{seed}", seed,
                                      None, device, None, None, compare.DEFAULT_VAL_BATCHES,
                                      deterministic)


def train_one(spec: str, preset: str, steps: int, seed: int, out: str, device: str,
              deterministic: bool = False) -> compare.RunResult:
    """One recipe and seed, as compare trains it (in a worker process), with torch's
    deterministic algorithms on for the run when asked (compare.run_plan does the same)."""
    plan = _plan(spec, preset, steps, seed, Path(out), device, deterministic)
    (label, recipe), = plan.recipes
    with compare.deterministic_algorithms(plan.deterministic):
        run = compare.train_recipe(plan, label, recipe)
    # each run on disk as soon as it ends: a pool stopped at a time limit keeps what finished
    finished = Path(out) / "runs"
    finished.mkdir(parents=True, exist_ok=True)
    (finished / f"{label.replace('/', '_')[:80]}-{abs(hash(spec)) % 10**8}-{seed}.json"
     ).write_text(json.dumps({"spec": spec, "seed": seed, **asdict(run)}, default=str))
    return run


def train_all(specs: list[str], preset: str, steps: int, seed_list: list[int], out: Path,
              device: str, jobs: int, deterministic: bool = False
              ) -> dict[tuple[str, int], compare.RunResult]:
    """Every (recipe, seed) run in parallel processes; also written to out/runs.json."""
    tasks = [(spec, seed) for spec in specs for seed in seed_list]
    # the slow formats first (NVFP4 is emulated on Hopper), so the pool ends together
    tasks.sort(key=lambda task: "nvfp4" not in task[0])
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = {task: pool.submit(train_one, task[0], preset, steps, task[1], str(out),
                                     device, deterministic) for task in tasks}
        results = {task: future.result() for task, future in futures.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(
        [{"spec": spec, "seed": seed, **asdict(run)} for (spec, seed), run in results.items()],
        default=str) + "\n")
    return results


def load_runs(out: Path) -> dict[tuple[str, int], compare.RunResult]:
    """The runs train_all wrote (to summarise again elsewhere, e.g. to plot on another host)."""
    runs = {}
    entries = (json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists()
               else [json.loads(path.read_text()) for path in sorted((out / "runs").glob("*"))])
    for entry in entries:
        spec, seed = entry.pop("spec"), entry.pop("seed")
        entry["val_loss"] = [tuple(point) for point in entry["val_loss"]]
        runs[(spec, seed)] = compare.RunResult(**entry)
    return runs


def summarise(results: dict[tuple[str, int], compare.RunResult], specs: list[str],
              preset: str, steps: int, seed_list: list[int], out: Path, device: str,
              jobs: int, deterministic: bool = False) -> dict:
    """Per seed compare's reports (out/seed{N}), over the seeds lab.seeds' summary."""
    comparisons, flags = [], []
    for seed in seed_list:
        plan = _plan(",".join(specs), preset, steps, seed, out, device, deterministic)
        comparison = compare.Comparison(plan)
        for spec, (label, _) in zip(specs, plan.recipes, strict=True):
            run = results[(spec, seed)]
            if run.label != label:
                raise RuntimeError(f"worker label {run.label!r} is not the plan's {label!r}")
            comparison.runs.append(run)
            flags += loss_flags(f"{label} seed {seed}", run.train_loss)
        write_reports(comparison)
        comparisons.append(comparison)
    seeds.write_summary(comparisons, out)
    summary = seeds.summarise(comparisons)
    return {"benchmark": "recipe_seeds", "date": datetime.now(timezone.utc).isoformat(),
            "preset": preset, "steps": steps, "seeds": seed_list, "recipes": specs,
            "jobs": jobs, "deterministic": deterministic, "summary": summary,
            "health_flags": flags, "config": comparisons[0].plan.describe()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipes", default="bf16,fp8-current,fp8-delayed,fp8-block,mxfp8,nvfp4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--jobs", type=int, default=0, help="parallel runs (default: one per "
                        "run, at most the CPU count)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch's deterministic algorithms in every run, where they exist")
    parser.add_argument("--summarise-only", action="store_true",
                        help="train nothing: summarise OUT/runs.json again (e.g. to plot)")
    args = parser.parse_args(argv)
    specs = [spec for spec in args.recipes.split(",") if spec]
    seed_list = [int(value) for value in args.seeds.split(",")]
    jobs = args.jobs or min(len(specs) * len(seed_list), os.cpu_count() or 1)
    if args.deterministic:
        compare.request_deterministic_cublas()
    if args.summarise_only:
        runs = load_runs(args.out)
    else:
        runs = train_all(specs, args.preset, args.steps, seed_list, args.out, args.device, jobs,
                         args.deterministic)
    result = summarise(runs, specs, args.preset, args.steps, seed_list, args.out, args.device,
                       jobs, args.deterministic)
    print((args.out / "seeds.txt").read_text())
    for flag in result["health_flags"]:
        print(f"health: {flag}")
    (args.out / "recipe_seeds.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
