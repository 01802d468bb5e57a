"""Where a model_step row's training step goes: GPU kernels by name, and the host's Python.

Why: model_step.py says how fast a row is; this says why. A row whose host time is close to
its step time is host-bound or waits on the GPU inside the step (a `.tolist()` of token counts,
an `.item()`): cProfile shows which (the wait shows as the time of the call that synchronises).
Its kernel table shows where the GPU time goes, grouped by kernel name.

For each row (model_step.py's row names and presets): build and convert the model as
model_step does, run --warmup steps, then
- the GPU kernels of --steps steps under torch.profiler: per kernel name, ms and calls a step,
  the --top largest, the total GPU time a step against the step's wall time, and the time by
  kind (kernel_kind: GEMMs, attention, minifloat's kernels, inductor's, optimizer, copies);
- cProfile of --steps more steps: the --top entries by own time and by cumulative time.

Usage: python benchmarks/profile_model.py --preset hf-mixtral-moe \\
           --rows bf16-eager,fp8-current-eager [--steps 3] [--warmup 3] [--top 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_step import (  # noqa: E402
    PRESETS,
    RowSpec,
    build_model,
    make_batches,
    prepare_row,
)

# kernel kinds, tested in order on a kernel's name (the first that matches names its kind)
KERNEL_KINDS = (
    ("copies", lambda name: name.startswith(("Memcpy", "Memset")) or "copy_kernel" in name
     or "CatArrayBatchedCopy" in name),
    # before GEMMs: inductor names its kernels after the ops they fuse (gemms_forward, ...)
    ("inductor-generated", lambda name: name.startswith("triton_")),
    ("attention", lambda name: any(part in name for part in ("sdpa", "flash", "fmha",
                                                               "cudnn::fusion"))),
    ("GEMMs", lambda name: name.startswith("nvjet") or "gemm" in name.lower()
     or "cutlass" in name or "xmma" in name),
    ("optimizer", lambda name: "multi_tensor_apply_kernel" in name),
    # minifloat's Triton kernels (quantize, decode, epilogue): plain names, no C++ scope
    ("minifloat kernels", lambda name: "::" not in name and " " not in name
     and name.endswith("kernel")),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its profiler name: copies, attention, GEMMs, optimizer,
    inductor-generated, minifloat kernels, or other (aten elementwise, reductions, indexing)."""
    for kind, matches in KERNEL_KINDS:
        if matches(name):
            return kind
    return "other"


def kernel_table(step, batches: list[torch.Tensor], top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for tokens in batches:
            step(tokens)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / len(batches)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += event.device_time_total / 1e3 / len(batches)
            entry[1] += 1 / len(batches)
    rows = sorted(({"kernel": name[:100], "ms_per_step": ms, "calls_per_step": calls}
                   for name, (ms, calls) in totals.items()), key=lambda row: -row["ms_per_step"])
    by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, _) in totals.items():
        by_kind[kernel_kind(name)] += ms
    return {"profiled_wall_ms_per_step": wall,
            "gpu_ms_per_step": sum(row["ms_per_step"] for row in rows),
            "kernels_per_step": sum(row["calls_per_step"] for row in rows),
            "ms_per_step_by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
            "top_kernels": rows[:top]}


def host_profile(step, batches: list[torch.Tensor], top: int) -> str:
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for tokens in batches:
        step(tokens)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--rows", default="bf16-eager,fp8-current-eager")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    config = PRESETS[args.preset]
    batches = make_batches(config, args.warmup + 2 * args.steps, "cuda")
    results = []
    for name in args.rows.split(","):
        spec = RowSpec.parse(name)
        train = prepare_row(spec, build_model(config, "cuda"), "cuda", batches[0])
        for tokens in batches[:args.warmup]:
            train(tokens)
        timed = batches[args.warmup:args.warmup + args.steps]
        table = kernel_table(train, timed, args.top)
        host = host_profile(train, batches[args.warmup + args.steps:], args.top)
        print(f"== {args.preset} {name}: profiled wall {table['profiled_wall_ms_per_step']:.2f} "
              f"ms/step, GPU {table['gpu_ms_per_step']:.2f} ms/step, "
              f"{table['kernels_per_step']:.0f} kernels/step")
        print("  by kind: " + ", ".join(f"{kind} {ms:.2f} ms"
                                         for kind, ms in table["ms_per_step_by_kind"].items()))
        for row in table["top_kernels"]:
            print(f"  {row['ms_per_step']:8.3f} ms {row['calls_per_step']:7.1f} x  "
                  f"{row['kernel']}")
        print(host)
        results.append({"row": name, **table, "host_profile": host})
        del train
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(json.dumps({"preset": args.preset, "device":
                                        torch.cuda.get_device_name(), "rows": results},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
