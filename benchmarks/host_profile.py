"""Host (Python) time of one Linear forward+backward step, and where it goes.

At (16384, 4096, 4096) the eager FP8 step is bound by the host: issuing its kernels takes about
as long as the GPU needs to run them (BENCHMARKS.md, profile). This script measures the host's
share alone: steps at a small shape (the GPU finishes each kernel long before the next is
issued) timed back to back without a sync, then the same steps under cProfile, sorted by own
time and by cumulative time, so the Python worth cutting shows up by name.

Usage: python benchmarks/host_profile.py [--recipes bf16,fp8-current,...] [--shape MxKxN]
       [--steps N] [--out DIR]   (writes host_profile_<recipe>.txt under DIR)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import linear_step  # noqa: E402
import profile_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="bf16,fp8-current,fp8-delayed,fp8-block")
    parser.add_argument("--shape", default="1024x1024x1024")
    parser.add_argument("--steps", type=int, default=200, help="steps under cProfile")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_profile: no CUDA device; skipped", file=sys.stderr)
        return 0
    m, k, n = (int(v) for v in args.shape.split("x"))
    summary = []
    for name in args.recipes.split(","):
        step = linear_step.step_for(name, m, k, n)
        for _ in range(20):  # compile, fill caches
            step()
        us = min(profile_step.host_ms(step) for _ in range(3)) * 1e3  # 20 steps each
        summary.append((name, us))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        text.write(f"{name} at {args.shape}: {us:.1f} us of host time a step (no profiler)\n")
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"host_profile_{name}.txt").write_text(text.getvalue())
    print(f"host time a step at {args.shape} on {torch.cuda.get_device_name()}:")
    for name, us in summary:
        print(f"  {name:14s} {us:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
