"""Where a Linear forward+backward step spends its time: device kernels and host dispatch.

For each recipe and shape: the step time (do_bench median, as linear_step.py measures it), the
host time to enqueue one step (wall time of steps issued back to back without a sync, so the
GPU never waits for them to finish), and torch.profiler's CUDA kernel time per step grouped by
kernel name. A step whose host time is close to its step time is CPU-bound: speeding up kernels
will not help it, cutting Python will.

Usage: python benchmarks/profile_step.py [--recipes fp8-current,nvfp4] [--shapes MxKxN,...]
       [--torchao] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import linear_step  # noqa: E402

PROFILED_STEPS = 10
ENQUEUED_STEPS = 20


def host_ms(step) -> float:
    """Host milliseconds to issue one step, the GPU kept busy (no sync inside the window)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ENQUEUED_STEPS):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / ENQUEUED_STEPS * 1e3


def _print_host_profile(step, top: int) -> None:
    """cProfile of the host loop: where the Python of a step goes (or where it waits)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(ENQUEUED_STEPS):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def _kernel_table(step) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += event.device_time_total / 1e3 / PROFILED_STEPS
            entry[1] += 1 / PROFILED_STEPS
    rows = [{"kernel": name[:90], "ms_per_step": ms, "calls_per_step": calls}
            for name, (ms, calls) in totals.items()]
    return sorted(rows, key=lambda row: -row["ms_per_step"])


def profile_one(name: str, m: int, k: int, n: int, host_profile: int = 0) -> dict:
    step = linear_step.step_for(name, m, k, n)
    for _ in range(10):
        step()
    if host_profile:
        _print_host_profile(step, host_profile)
    step_ms = linear_step._bench(step)
    issue_ms = host_ms(step)
    kernels = _kernel_table(step)
    return {"recipe": name, "shape": [m, k, n], "step_ms": step_ms, "host_ms": issue_ms,
            "kernel_ms": sum(row["ms_per_step"] for row in kernels), "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="bf16,fp8-current")
    parser.add_argument("--shapes", default="16384x4096x4096")
    parser.add_argument("--torchao", action="store_true", help="also torchao-tensorwise")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also print the N costliest functions of the host loop (cProfile)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step: no CUDA device; skipped", file=sys.stderr)
        return 0
    names = args.recipes.split(",") + (["torchao-tensorwise"] if args.torchao else [])
    results = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        for name in names:
            result = profile_one(name, m, k, n, args.host_profile)
            results.append(result)
            print(f"\n== {name} at {m}x{k}x{n}: step {result['step_ms']:.3f} ms, host "
                  f"{result['host_ms']:.3f} ms to issue, kernels {result['kernel_ms']:.3f} ms")
            for row in result["kernels"][:args.top]:
                print(f"  {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:<4.1f} "
                      f"{row['kernel']}")
            torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_step.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
