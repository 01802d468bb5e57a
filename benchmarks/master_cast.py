"""ZeRO master-weight casts at a model's scale: bandwidth and host time (issue 16's targets).

Why: a distributed optimizer (Megatron-style ZeRO) updates each rank's flat range of every
fp32 master weight and casts it into the quantized model weights every step
(minifloat.distributed.quantize_master_weights). Issue 16 asks, on an H200, with a 1b model's
weights split over 8 ranks: at least 0.7 of the copy bandwidth for the cast and at most 2 ms of
host time per step for all tensors. One process plays one rank (--rank of --ranks; no process
group, so no all-reduce: the cast's own cost), its ranges cut at equal flat offsets (inside
rows, tiles and, for NVFP4, bytes).

Per recipe row (the model weights built under quantized_model_init with that recipe):
- device_ms: median time of one cast (small_m.device_ms: triton's do_bench; on the CPU
  perf_counter).
- host_ms: median host time of one cast over --steps, the GPU queue drained before
  (small_m.host_us: perf_counter around the call; nothing synchronizes inside it unless the
  cast does).
- bytes: what a cast must move at least: the rank's fp32 masters read once and its quantized
  elements written once (1 byte each, NVFP4 half a byte; scales left out).
- gbps = bytes / device time; copy_gbps: torch's copy of a buffer of as many bytes read plus
  written, timed the same way; copy_fraction = gbps / copy_gbps.
- launches, kernel_ms: CUDA kernels of one cast and their summed GPU time (torch.profiler; GPU
  only); kernel_copy_fraction = bytes / kernel time / copy_gbps: the kernels' time against the
  minimum bytes above, which device_ms hides when the cast is host-bound; it counts one master
  read and one quantized copy, so it charges a format for the second read or copy it cannot do
  without. required_copy_fraction, the bandwidth the kernels reach on what the algorithm must
  move (issue 16's "0.7 of copy bandwidth for the cast kernels"), counts the masters read as
  often as the format needs (twice for current scaling and NVFP4, whose per-tensor amax is all-
  reduced between the maxima pass and the cast; once for delayed scaling, whose scale is known
  before, and for block FP8 and MXFP8, whose maxima pass casts every tile the range covers whole
  and rereads only the cut ones), the quantized bytes written (MXFP8: both copies), and every
  scale tensor of every weight written once (each rank writes them all: they are the same
  everywhere after the all-reduce). Reads of the maxima vector are left out (a lower bound).

--copies rowwise|columnwise keeps that one copy of each MXFP8 weight (update_usage before the
casts, so the cast writes only it): which store bounds the MXFP8 cast kernel (an ablation; a
trained MXFP8 weight keeps both). Other formats ignore it.

Usage: python benchmarks/master_cast.py [--preset 1b] [--ranks 8] [--rank 0]
       [--recipes fp8-current,fp8-delayed,fp8-block,mxfp8,nvfp4] [--steps 10] [--device cuda]
       [--host-profile] [--copies both|rowwise|columnwise]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_step import RESULTS, device_slug, environment, minifloat_recipe  # noqa: E402
from small_m import device_ms, host_us  # noqa: E402

import minifloat as mf  # noqa: E402
from minifloat.distributed import quantize_master_weights  # noqa: E402
from minifloat.models.torch_gpt import PRESETS, TorchGPT, not_head  # noqa: E402

BYTES_PER_ELEMENT = {"fp8-current": 1.0, "fp8-delayed": 1.0, "fp8-block": 1.0, "mxfp8": 1.0,
                     "nvfp4": 0.5}
WRITTEN_PER_ELEMENT = {**BYTES_PER_ELEMENT, "mxfp8": 2.0}  # MXFP8 weights keep both copies
# reads of the fp32 masters the algorithm needs: a per-tensor amax all-reduced before the cast
# (current scaling, NVFP4's global amax) means two passes; the others cast in the first pass
MASTER_READS = {"fp8-current": 2, "nvfp4": 2, "fp8-delayed": 1, "fp8-block": 1, "mxfp8": 1}
# the scale tensors the cast writes (the transposed copies' scales come after the gather)
SCALES_WRITTEN = {"fp8-current": ("scale_inv",), "fp8-delayed": ("scale_inv",),
                  "fp8-block": ("rowwise_scale_inv",), "nvfp4": ("rowwise_scale",),
                  "mxfp8": ("rowwise_scale", "columnwise_scale")}


def weight_shapes(preset: str) -> list[tuple[int, int]]:
    """[out, in] of every Linear weight of the preset's GPT that a recipe converts (the head
    stays in bf16), read from a model built on the meta device."""
    model = TorchGPT(PRESETS[preset], device="meta")
    return [tuple(module.weight.shape) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and not_head(name, module)]


def rank_ranges(shapes: list[tuple[int, int]], ranks: int, rank: int) -> list[tuple[int, int]]:
    """(start, count) of this rank's flat range of each weight: equal cuts, the last rank
    taking the remainder."""
    ranges = []
    for n, k in shapes:
        size = n * k
        start = size * rank // ranks
        ranges.append((start, size * (rank + 1) // ranks - start))
    return ranges


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kernels_of(run, device: str) -> tuple[int | None, float | None, dict[str, float]]:
    """(CUDA kernels one cast launches, their summed GPU time in ms, ms per kernel name) from
    torch.profiler; the kernel time leaves out the host's gaps between launches (device_ms
    includes them when the cast is host-bound). (None, None, {}) off CUDA."""
    if not device.startswith("cuda"):
        return None, None, {}
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        _sync(device)
    events = [event for event in profile.events()
              if event.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, float] = {}
    for event in events:
        per_kernel[event.name[:60]] = per_kernel.get(event.name[:60], 0.0) + event.device_time / 1e3
    return len(events), sum(per_kernel.values()), per_kernel


def copy_gbps(total_bytes: int, device: str) -> float:
    """Bandwidth of torch's copy moving total_bytes (half read, half written)."""
    half = max(int(total_bytes) // 2, 1)
    source = torch.empty(half, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * half / (device_ms(lambda: target.copy_(source), device) * 1e-3) / 1e9


def print_host_profile(cast, name: str) -> None:
    """Where one cast's host time goes (cProfile, top entries by cumulative time)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(cast)
    print(f"--- host profile of one {name} cast")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(14)


def measure_recipe(name: str, shapes: list[tuple[int, int]], ranges: list[tuple[int, int]],
                   steps: int, device: str, profile: bool = False, copies: str = "both"
                   ) -> dict:
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=minifloat_recipe(name)):
        layers = [mf.Linear(k, n, bias=False, device=device) for n, k in shapes]
    weights = [layer.weight for layer in layers]
    written = WRITTEN_PER_ELEMENT[name]
    if name == "mxfp8" and copies != "both":  # the ablation: one copy written
        for weight in weights:
            weight.quantized_storage.update_usage(rowwise=copies == "rowwise",
                                                  columnwise=copies == "columnwise")
        written = BYTES_PER_ELEMENT[name]
    generator = torch.Generator(device=device).manual_seed(1)
    masters = [torch.randn(count, generator=generator, device=device) * 0.02
               for _, count in ranges]
    starts = [start for start, _ in ranges]

    def cast() -> None:
        quantize_master_weights(weights, masters, starts, group=None)

    for _ in range(2):  # warm-up: kernel compilation, caches
        cast()
    elements = sum(count for _, count in ranges)
    moved = int(elements * (4 + BYTES_PER_ELEMENT[name]))
    device_time = device_ms(cast, device)
    if profile:
        print_host_profile(cast, name)
    launches, kernel_ms, per_kernel = kernels_of(cast, device)
    row = {"row": name, "copies": copies if name == "mxfp8" else "both",
           "weights": len(weights), "rank_elements": elements, "bytes": moved,
           "device_ms": device_time, "host_ms": host_us(cast, device, repeats=steps) / 1e3,
           "gbps": moved / (device_time * 1e-3) / 1e9, "launches": launches,
           "kernel_ms": kernel_ms, "kernel_ms_by_name": per_kernel}
    row["copy_gbps"] = copy_gbps(moved, device)
    row["copy_fraction"] = row["gbps"] / row["copy_gbps"]
    # what the algorithm must move (module docstring)
    row["scale_bytes"] = sum(tensor.nbytes for weight in weights
                             for field in SCALES_WRITTEN[name]
                             if (tensor := getattr(weight.quantized_storage, field)) is not None)
    row["required_bytes"] = (int(elements * (MASTER_READS[name] * 4 + written))
                             + row["scale_bytes"])
    if kernel_ms:  # the cast kernels' own bandwidth (issue 16's target)
        row["kernel_copy_fraction"] = moved / (kernel_ms * 1e-3) / 1e9 / row["copy_gbps"]
        row["required_copy_fraction"] = (row["required_bytes"] / (kernel_ms * 1e-3) / 1e9
                                         / row["copy_gbps"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--recipes", default="fp8-current,fp8-delayed,fp8-block,mxfp8,nvfp4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--host-profile", action="store_true",
                        help="print a cProfile of one cast per recipe")
    parser.add_argument("--copies", default="both", choices=("both", "rowwise", "columnwise"),
                        help="MXFP8 weights keep this copy only (see the module docstring)")
    args = parser.parse_args(argv)
    recipes = [name for name in args.recipes.split(",") if name]
    unknown = [name for name in recipes if name not in BYTES_PER_ELEMENT]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; choose from {', '.join(BYTES_PER_ELEMENT)}")
    if not 0 <= args.rank < args.ranks:
        parser.error(f"--rank must be in [0, {args.ranks}), got {args.rank}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("master_cast: no CUDA device; skipped (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 0
    shapes = weight_shapes(args.preset)
    ranges = rank_ranges(shapes, args.ranks, args.rank)
    env = environment(args.device)
    data = {"benchmark": "master_cast", **env, "preset": args.preset, "ranks": args.ranks,
            "rank": args.rank, "steps": args.steps, "rows": []}
    print(f"master_cast on {env['device']}: {args.preset}, {len(shapes)} weights, rank "
          f"{args.rank} of {args.ranks}", flush=True)
    for name in recipes:
        try:
            row = measure_recipe(name, shapes, ranges, args.steps, args.device,
                                 args.host_profile, args.copies)
        except Exception as error:  # noqa: BLE001 - recorded, the other recipes still run
            row = {"row": name, "error": f"{type(error).__name__}: {error}"[:500]}
        data["rows"].append(row)
        if "error" in row:
            print(f"{name:12s} failed: {row['error']}", flush=True)
        else:
            print(f"{name:12s} {row['device_ms']:9.3f} ms  host {row['host_ms']:8.3f} ms  "
                  f"{row['gbps']:7.1f} GB/s = {row['copy_fraction']:.2f} of copy "
                  f"({row['copy_gbps']:.1f})  launches {row['launches']}  kernels "
                  f"{row['kernel_ms'] or 0:.3f} ms = {row.get('kernel_copy_fraction', 0):.2f} "
                  f"of copy (required bytes {row.get('required_copy_fraction', 0):.2f})",
                  flush=True)
            for kernel, ms in row.get("kernel_ms_by_name", {}).items():
                print(f"    {ms:8.3f} ms  {kernel}", flush=True)
    out = args.out or RESULTS / f"master_cast_{device_slug(env)}_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
