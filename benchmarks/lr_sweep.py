"""Learning-rate sweep of the lab's bf16 baseline, per preset (issue 19): which peak learning
rate trains each preset best, with its noise, so the lab's defaults leave the early plateau.

For each learning rate and seed, `python -m minifloat compare --recipes bf16` (the lab's own
training loop: AdamW, warm-up then cosine, grad clip 1.0) runs the preset; the table gives the
final validation loss per learning rate as mean and min..max over the seeds, and the health
flags (a plateau, a spike, NaN) of each run. Results go to one JSON file.

Usage:
  python benchmarks/lr_sweep.py --preset tiny --steps 300 --lrs 3e-4,1e-3,3e-3,1e-2 \\
      --seeds 0,1 [--device cpu|cuda] [--out benchmarks/results/lr_sweep_tiny.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minifloat.lab import compare  # noqa: E402
from minifloat.lab.health import loss_flags  # noqa: E402


def sweep(preset: str, steps: int, lrs: list[float], seeds: list[int], device: str) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for lr in lrs:
            finals, flags = [], []
            for seed in seeds:
                result = compare.run_comparison(
                    "bf16", steps=steps, preset=preset, out_dir=Path(folder) / f"{lr}-{seed}",
                    seed=seed, device=device, lr=lr, progress=False)
                run = result.runs[0]
                finals.append(run.final_val_loss)
                flags += loss_flags(f"lr {lr:g} seed {seed}", run.train_loss)
            rows.append({"lr": lr, "val_losses": finals, "mean": statistics.fmean(finals),
                         "min": min(finals), "max": max(finals), "flags": flags})
    best = min(rows, key=lambda row: row["mean"])
    return {"benchmark": "lr_sweep", "date": datetime.now(timezone.utc).isoformat(),
            "preset": preset, "steps": steps, "seeds": seeds, "device": device,
            "torch": torch.__version__, "rows": rows, "best_lr": best["lr"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = sweep(args.preset, args.steps, [float(v) for v in args.lrs.split(",")],
                   [int(v) for v in args.seeds.split(",")], args.device)
    print(f"{args.preset} preset, {args.steps} steps, bf16, seeds {result['seeds']}:")
    for row in result["rows"]:
        mark = "  <- best" if row["lr"] == result["best_lr"] else ""
        print(f"  lr {row['lr']:<8g} val loss {row['mean']:.4f} "
              f"({row['min']:.4f}..{row['max']:.4f}){mark}")
        for flag in row["flags"]:
            print(f"    {flag}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
