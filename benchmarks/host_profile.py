"""Host (Python) time of one Linear's forward and of its backward, and where each goes.

Why: at 16 tokens the GPU finishes every kernel long before the host issues the next, so a
step's time is the host's: the Python that minifloat runs around each GEMM (quantizer calls,
scale bookkeeping, autograd.Function) against the few C++ dispatches of a plain nn.Linear. The
issue's target (FP8 forward+backward on 16 tokens at most 1.3x the bf16 one) is won or lost
here, so this script shows the two phases apart, each with its cProfile top entries.

For each layer (default: plain nn.Linear "bf16" and minifloat.Linear under FP8 current scaling)
at --shape MxKxN (default 16x2048x2048: 16 tokens, a 1b-preset projection):
- forward host us: synchronize, perf_counter, y = layer(x) (under minifloat.autocast for a
  recipe), perf_counter; median over --repeats.
- backward host us: the same around y.backward(dy), with autograd's device thread (CUDA's
  default), and again with torch.autograd.set_multithreading_enabled(False), where backward
  runs on the calling thread: on CUDA the default hands the GIL to that thread and back.
- cProfile of --repeats forwards and, apart, of --repeats backwards (the latter single-threaded:
  cProfile sees only the thread it runs on), top --top entries by own time and cumulative time.

--stub-kernels (per-tensor FP8 recipes, which take the lean path): the lean path's casts and
scaled matmuls return preallocated buffers of the right shapes instead of launching anything,
so the figures are minifloat's Python above the kernel layer alone (module, autocast lookup,
autograd.Function, bookkeeping); the difference to a run without it is the kernel layer's host
cost (Triton launches and their arguments, scaled_mm). Outputs are then meaningless. Delayed
scaling's forward includes autocast's exit, where its scales update (one batched kernel on a
GPU, a few dozen torch ops on the CPU).

Usage: python benchmarks/host_profile.py [--recipes bf16,fp8-current,...] [--shape 16x2048x2048]
       [--repeats 200] [--top 25] [--device cuda|cpu] [--out DIR] [--stub-kernels]
Recipes: bf16 (plain torch.nn.Linear), fp8-current, fp8-delayed, fp8-block, mxfp8, nvfp4. With
--out DIR, each layer's report goes to DIR/host_profile_<recipe>.txt as well.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_step import minifloat_recipe  # noqa: E402

WARMUP = 20


def build_layer(name: str, k: int, n: int, device: str, dtype: torch.dtype):
    """(layer, autocast context factory): nn.Linear for "bf16", else minifloat.Linear."""
    torch.manual_seed(0)
    if name == "bf16":
        layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        return layer, contextlib.nullcontext
    import minifloat as mf

    recipe = minifloat_recipe(name)
    layer = mf.Linear(k, n, bias=False, params_dtype=dtype, device=device)
    return layer, lambda: mf.autocast(recipe=recipe)


@contextlib.contextmanager
def stubbed_kernel_layer(device: str):
    """The lean FP8 path with its kernel layer replaced by preallocated buffers (see the
    module docstring); on the CPU the lean path is widened to serve CPU tensors."""
    from minifloat.modules import lean_fp8

    buffers: dict[tuple, torch.Tensor] = {}

    def buffer(shape: tuple, dtype: torch.dtype, on: torch.device) -> torch.Tensor:
        key = (shape, dtype, on)
        if key not in buffers:
            buffers[key] = torch.zeros(shape, dtype=dtype, device=on)
        return buffers[key]

    def cast(self, x2d, *, rowwise, columnwise, amax=None):
        m, k = x2d.shape
        return (buffer((m, k), self.fp8_dtype, x2d.device) if rowwise else None,
                buffer((k, m), self.fp8_dtype, x2d.device) if columnwise else None,
                buffer((1,), torch.float32, x2d.device))

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, fast_accumulation):
        return torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)

    saved = (lean_fp8.Cast.__call__, lean_fp8.scaled_mm_bytes, lean_fp8.DEVICES)
    lean_fp8.Cast.__call__, lean_fp8.scaled_mm_bytes = cast, scaled_mm
    lean_fp8.DEVICES = (torch.device(device).type,)
    try:
        yield
    finally:
        lean_fp8.Cast.__call__, lean_fp8.scaled_mm_bytes, lean_fp8.DEVICES = saved


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def phase_times(layer, context: Callable, x: torch.Tensor, dy: torch.Tensor, repeats: int,
                device: str, single_thread: bool) -> tuple[list[float], list[float]]:
    """Host us of each forward and each backward (synchronized before, none inside)."""
    forward, backward = [], []
    with torch.autograd.set_multithreading_enabled(not single_thread):
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            with context():
                y = layer(x)
            forward.append((time.perf_counter() - start) * 1e6)
            _sync(device)
            start = time.perf_counter()
            y.backward(dy)
            backward.append((time.perf_counter() - start) * 1e6)
            _sync(device)
            x.grad = None
            layer.weight.grad = None
    return forward, backward


def profiles(layer, context: Callable, x: torch.Tensor, dy: torch.Tensor, repeats: int,
             device: str) -> tuple[cProfile.Profile, cProfile.Profile]:
    """cProfile of the forwards and, apart, of the backwards (on the calling thread)."""
    forward, backward = cProfile.Profile(), cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(repeats):
            _sync(device)
            forward.enable()
            with context():
                y = layer(x)
            forward.disable()
            _sync(device)
            backward.enable()
            y.backward(dy)
            backward.disable()
            _sync(device)
            x.grad = None
            layer.weight.grad = None
    return forward, backward


def _top(profile: cProfile.Profile, top: int, title: str) -> str:
    text = io.StringIO()
    text.write(f"--- {title}\n")
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def report(name: str, m: int, k: int, n: int, repeats: int, top: int, device: str,
           dtype: torch.dtype) -> tuple[dict, str]:
    """Median host us of each phase for one layer, and its cProfile text."""
    layer, context = build_layer(name, k, n, device, dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    phase_times(layer, context, x, dy, WARMUP, device, single_thread=False)  # compile, caches
    fwd, bwd = phase_times(layer, context, x, dy, repeats, device, single_thread=False)
    _, bwd_1t = phase_times(layer, context, x, dy, repeats, device, single_thread=True)
    result = {"layer": name, "forward_us": statistics.median(fwd),
              "backward_us": statistics.median(bwd),
              "backward_single_thread_us": statistics.median(bwd_1t)}
    forward_profile, backward_profile = profiles(layer, context, x, dy, repeats, device)
    header = (f"{name} at {m}x{k}x{n} on {device}: forward {result['forward_us']:.1f} us, "
              f"backward {result['backward_us']:.1f} us (single-thread "
              f"{result['backward_single_thread_us']:.1f} us) of host time, no profiler; "
              f"profiles of {repeats} calls each follow\n")
    text = (header + _top(forward_profile, top, f"{name} forward")
            + _top(backward_profile, top, f"{name} backward (calling thread)"))
    return result, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="bf16,fp8-current")
    parser.add_argument("--shape", default="16x2048x2048", help="MxKxN (M tokens)")
    parser.add_argument("--repeats", type=int, default=200, help="timed and profiled calls")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--stub-kernels", action="store_true",
                        help="time minifloat's Python above the kernel layer alone")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("host_profile: no CUDA device; skipped (--device cpu runs on the CPU)",
              file=sys.stderr)
        return 0
    m, k, n = (int(v) for v in args.shape.split("x"))
    # bf16 as on a GPU; fp32 on the CPU, where bf16 matmuls are slow emulation without AMX
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    summary = []
    for name in args.recipes.split(","):
        stub = args.stub_kernels and name in ("fp8-current", "fp8-delayed")
        with stubbed_kernel_layer(args.device) if stub else contextlib.nullcontext():
            result, text = report(name, m, k, n, args.repeats, args.top, args.device, dtype)
        if stub:
            result["layer"] = f"{name} (stubbed kernels)"
            text = "kernel layer stubbed (--stub-kernels): " + text
        summary.append(result)
        print(text, flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"host_profile_{name}.txt").write_text(text)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"host time per call at {args.shape} on {device} ({dtype}), medians of "
          f"{args.repeats}:")
    print(f"  {'layer':14s} {'forward us':>11s} {'backward us':>12s} {'bwd 1-thread':>13s}")
    base = next((row for row in summary if row["layer"] == "bf16"), None)
    for row in summary:
        ratio = ""
        if base is not None and row is not base:
            total = row["forward_us"] + row["backward_us"]
            ratio = f"  fwd+bwd {total / (base['forward_us'] + base['backward_us']):.2f}x bf16"
        print(f"  {row['layer']:14s} {row['forward_us']:11.1f} {row['backward_us']:12.1f} "
              f"{row['backward_single_thread_us']:13.1f}{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
