"""Host (Python) time below the module: quantizer calls, storages and general_gemm dispatch.

A quantized Linear forward+backward makes, per split, this sequence of calls (modules/
linear_function.py): quantize x (rowwise + columnwise) through split_quantize, quantize W (both
copies), general_gemm fprop, drop x's rowwise copy and hand its buffers to save_for_backward,
quantize dY (both copies), general_gemm dgrad, restore x's buffers, general_gemm wgrad. This
script makes exactly those calls for each recipe's quantizers, on tiny tensors (x 32x256,
W 256x256, bf16) so that the torch ops are cheap and what is left is mostly the Python around
them, and reports microseconds per call and per simulated step, then cProfile's top entries.

Runs anywhere (CPU by default, where the numerics reference replaces the Triton kernels, so the
torch op time is the reference's, not the kernels'). The torch.profiler columns split the step:
the number of aten ops it runs and their own CPU time (dispatch included) against the step's
time under that profiler; the remainder is Python around the ops (isinstance chains, storage
construction, quantizer copies, shape checks). 32x32x32 (--shape) leaves the ops nearly free.

Usage: python benchmarks/quantize_host_time.py [--recipes fp8-current,...] [--iters N]
       [--device cpu|cuda] [--top N] [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable

import torch

import minifloat as mf
from minifloat.quantizers.split import split_quantize

SHAPE = (32, 256, 256)  # M, K, N; MXFP8 needs M % 32 == 0: the smallest M every recipe takes


def _quantizers(name: str, device: torch.device) -> tuple:
    """(x, W, dY) quantizers of one recipe, configured as the recipe states make them."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    if name == "fp8-delayed":
        def delayed(dtype):
            return mf.Float8Quantizer(torch.ones(1, device=device),
                                      torch.zeros(1, device=device), dtype)
        return delayed(e4m3), delayed(e4m3), delayed(e5m2)
    if name == "fp8-current":
        return (mf.Float8CurrentScalingQuantizer(e4m3), mf.Float8CurrentScalingQuantizer(e4m3),
                mf.Float8CurrentScalingQuantizer(e5m2))
    if name == "fp8-block":
        return (mf.Float8BlockQuantizer(1), mf.Float8BlockQuantizer(2),
                mf.Float8BlockQuantizer(1))
    if name == "mxfp8":
        return mf.MXFP8Quantizer(), mf.MXFP8Quantizer(), mf.MXFP8Quantizer()
    if name == "nvfp4":
        return (mf.NVFP4Quantizer(with_rht=True), mf.NVFP4Quantizer(with_2d_quantization=True),
                mf.NVFP4Quantizer(with_rht=True, stochastic_rounding=True))
    if name == "hybrid":  # MXFP8 forward, NVFP4 backward (the README's hybrid:mxfp8/nvfp4)
        return (
            mf.HybridQuantizer(mf.MXFP8Quantizer(), mf.NVFP4Quantizer(with_rht=True)),
            mf.HybridQuantizer(mf.MXFP8Quantizer(),
                               mf.NVFP4Quantizer(with_2d_quantization=True)),
            mf.HybridQuantizer(mf.NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
                               mf.NVFP4Quantizer(with_rht=True, stochastic_rounding=True)),
        )
    raise ValueError(f"unknown recipe {name!r}")


_STUB_CALLS = [0]
_PLAIN = (bool, int, float, torch.dtype, type(None))


def stub_numerics() -> None:
    """Glue-only mode: every function of minifloat.numerics returns the result of its first
    call with a first argument of the same shape and the same plain keyword values, so that
    the reference's torch ops drop out and the step measures the Python around them (plus the
    few torch ops the quantizers and general_gemm run themselves: detach, transposes, views).
    The outputs are wrong values of the right shapes: for timing only. Each stubbed call costs
    about a microsecond of its own (measured by stub_cost and subtracted in the report)."""
    import minifloat.numerics as numerics

    for name in numerics.__all__:
        function = getattr(numerics, name)
        if not callable(function) or isinstance(function, type):
            continue

        def memo(*args, _function=function, _cache={}, **kwargs):  # noqa: B006
            _STUB_CALLS[0] += 1
            first = args[0]
            key = (first.shape if isinstance(first, torch.Tensor) else first, len(args),
                   *[v if type(v) in _PLAIN else None for v in kwargs.values()])
            result = _cache.get(key)
            if result is None:
                result = _cache[key] = _function(*args, **kwargs)
            return result

        setattr(numerics, name, memo)


def stub_cost() -> float:
    """Microseconds one stubbed numerics call costs (a cache hit with three plain keywords)."""
    import minifloat.numerics as numerics

    x = torch.zeros(32, 32)
    numerics.quantize_mxfp8(x, rowwise=True, columnwise=True, dtype=torch.float8_e4m3fn)
    start = time.perf_counter()
    for _ in range(10000):
        numerics.quantize_mxfp8(x, rowwise=True, columnwise=True, dtype=torch.float8_e4m3fn)
    return (time.perf_counter() - start) / 10000 * 1e6


def _configure(quantizer) -> None:
    """What the module does before each quantize call (linear_function.quantize_for_gemms)."""
    quantizer.set_usage(rowwise=True, columnwise=True)
    quantizer.internal = True


def operations(name: str, device: torch.device, shape: tuple[int, int, int] = SHAPE
               ) -> list[tuple[str, Callable[[], object]]]:
    """The calls of one simulated Linear step, each a closure over shared state, in order."""
    m, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    dy = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    qx, qw, qdy = _quantizers(name, device)
    state: dict = {}

    def quantize_x():
        _configure(qx)
        state["x"] = split_quantize(x, [m], [qx])[0]

    def quantize_w():
        _configure(qw)
        state["w"] = qw(w)

    def fprop():
        return mf.general_gemm(state["x"], state["w"], out_dtype=torch.bfloat16)

    def save_x():  # columnwise_copies_for_backward
        state["x"].update_usage(rowwise=False)
        state["saved"], state["x"] = state["x"].prepare_for_saving()

    def quantize_dy():
        _configure(qdy)
        state["dy"] = split_quantize(dy, [m], [qdy])[0]

    def dgrad():
        return mf.general_gemm(state["dy"], state["w"], b_columnwise=True,
                               out_dtype=torch.bfloat16)

    def restore_x():
        state["x"].restore_from_saved(state["saved"])

    def wgrad():
        return mf.general_gemm(state["dy"], state["x"], a_columnwise=True, b_columnwise=True,
                               out_dtype=torch.bfloat16)

    return [("quantize x", quantize_x), ("quantize W", quantize_w), ("gemm fprop", fprop),
            ("save x", save_x), ("quantize dY", quantize_dy), ("gemm dgrad", dgrad),
            ("restore x", restore_x), ("gemm wgrad", wgrad)]


def bf16_operations(device: torch.device, shape: tuple[int, int, int] = SHAPE
                    ) -> list[tuple[str, Callable[[], object]]]:
    """The three plain matmuls of a bf16 Linear step at the same shapes, for scale."""
    m, k, n = shape
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    dy = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    return [("gemm fprop", lambda: x @ w.t()), ("gemm dgrad", lambda: dy @ w),
            ("gemm wgrad", lambda: dy.t() @ x)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(ops, iters: int, repeats: int, device: torch.device) -> dict[str, float]:
    """The least over `repeats` of the mean microseconds per call of each op, and of the step
    (the least, not the median: on a shared machine the noise only ever adds time)."""
    for _ in range(5):  # warm-up: caches, first-call imports
        for _, op in ops:
            op()
    samples: dict[str, list[float]] = {label: [] for label, _ in ops}
    samples["step"] = []
    for _ in range(repeats):
        totals = dict.fromkeys(samples, 0.0)
        for _ in range(iters):
            step_start = time.perf_counter()
            for label, op in ops:
                start = time.perf_counter()
                op()
                totals[label] += time.perf_counter() - start
            totals["step"] += time.perf_counter() - step_start
        _sync(device)
        for label, total in totals.items():
            samples[label].append(total / iters * 1e6)
    return {label: min(values) for label, values in samples.items()}


def torch_op_time(ops, iters: int) -> tuple[float, float, float]:
    """(torch op microseconds per step, op count per step, profiled step microseconds) from
    torch.profiler: the self CPU time of every aten op, i.e. what torch itself spends (dispatch
    included); the step's other time is Python around the ops. Both sides carry the
    profiler's per-op recording cost, so the op share is a little high."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            for _, op in ops:
                op()
        elapsed = time.perf_counter() - start
    events = prof.key_averages()
    own = sum(event.self_cpu_time_total for event in events)  # microseconds
    count = sum(event.count for event in events if event.key.startswith("aten::"))
    return own / iters, count / iters, elapsed / iters * 1e6


def profile(ops, iters: int, top: int) -> str:
    """cProfile text: the top entries by own time. Tensor operators (+, *, <<, comparisons)
    are not calls to cProfile: their time lands in the Python function that uses them."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        for _, op in ops:
            op()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="fp8-delayed,fp8-current,fp8-block,mxfp8,nvfp4,"
                                             "hybrid")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="x".join(map(str, SHAPE)),
                        help="MxKxN: x [M, K], W [N, K] (32x32x32 leaves little but Python)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--glue", action="store_true",
                        help="stub the numerics reference out (stub_numerics): Python alone")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    stub_us = 0.0
    if args.glue:
        stub_numerics()
        stub_us = stub_cost()
    device = torch.device(args.device)
    shape = tuple(int(v) for v in args.shape.split("x"))
    m, k, n = shape
    results: dict[str, dict] = {}
    stubbed = ", numerics stubbed (--glue)" if args.glue else ""
    print(f"x {m}x{k}, W {n}x{k}, bf16, {device}, torch {torch.__version__}, "
          f"{args.threads} thread(s){stubbed}; microseconds per call (least of {args.repeats} "
          f"means of {args.iters})")
    if args.glue:
        print(f"a stubbed numerics call costs {stub_us:.2f} us (subtracted from 'glue')")
    bf16 = measure(bf16_operations(device, shape), args.iters, args.repeats, device)
    print(f"bf16 (3 plain matmuls): step {bf16['step']:.1f} us")
    results["bf16"] = {"us": bf16}
    profiles = []
    for name in args.recipes.split(","):
        ops = operations(name, device, shape)
        before = _STUB_CALLS[0]
        figures = measure(ops, args.iters, args.repeats, device)
        entry: dict = {"us": figures}
        line = "  ".join(f"{label} {figures[label]:7.1f}" for label, _ in ops)
        if args.glue:
            steps = args.iters * args.repeats + 5
            calls = (_STUB_CALLS[0] - before) / steps
            entry.update(stub_calls=calls, glue_step_us=figures["step"] - calls * stub_us)
            line += (f"  | {calls:.0f} stubbed calls: glue {entry['glue_step_us']:.1f} us a "
                     "step")
        if not args.no_profile:
            op_us, op_count, profiled_us = torch_op_time(ops, max(args.iters // 4, 20))
            entry.update(torch_op_us=op_us, torch_ops=op_count, profiled_step_us=profiled_us)
            profiles.append((name, profile(ops, max(args.iters // 4, 20), args.top)))
            line += (f"  | {op_count:.0f} torch ops, {op_us:.0f} of {profiled_us:.0f} us "
                     "profiled in them")
        print(f"{name:12s} step {figures['step']:7.1f} | {line}")
        results[name] = entry
    for name, text in profiles:
        print(f"\n===== {name}: cProfile, top entries by own time =====\n{text}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"shape": list(shape), "device": str(device), "torch": torch.__version__,
                       "threads": args.threads, "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
