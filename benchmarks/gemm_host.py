"""Host time of the calls an FP8 Linear is made of, against the one call of a bf16 Linear.

Why: at 16 tokens an FP8 forward+backward at the 1b preset costs 3.2-3.4x the bf16 one in host
time on the H100 hosts measured (issue 15 asks 1.3x), while minifloat's own Python above the
kernel layer is small (benchmarks/host_profile.py --stub-kernels). What is left is the kernel
layer: Triton launches, torch._scaled_mm (a cuBLASLt call set up per call) and allocations.
This prints each primitive's host cost alone, so the floor under the issue's target is known:
an eager FP8 Linear makes three casts and three _scaled_mm where bf16 makes three torch.mm.

Per primitive, at M x K x N (default 16 x 2048 x 2048): the median host time of one call (the
GPU queue drained before it, perf_counter around the call, no synchronisation inside):
- torch.mm on bf16, and torch.mm with out_dtype=float32 (the emulated NVFP4 GEMM's call);
- torch._scaled_mm on E4M3 bytes with per-tensor scales, fast accumulation on and off;
- torch._scaled_grouped_mm over 8 groups (the MoE experts' grouped GEMM; sm90 only);
- minifloat's per-tensor current-scaling cast (one launch, both copies, its allocations
  included);
- torch.empty of the cast's outputs (three allocations a cast);
- the same composed as a forward: the FP8 forward's three calls inline, minifloat.Linear's
  forward (autocast entered per call, or once for all), nn.Linear's forward (`composed`).

Usage: python benchmarks/gemm_host.py [--shape 16x2048x2048] [--repeats 300] [--out FILE]
Skips (exit 0, a message) without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def host_us(fn, repeats: int) -> float:
    """Median host microseconds of fn(), the GPU queue drained before each call."""
    for _ in range(10):  # warm-up: compilation, cuBLAS handles, allocator blocks
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def primitives(m: int, k: int, n: int) -> dict:
    """name -> zero-argument callable, on CUDA tensors of the given GEMM shape."""
    from minifloat.kernels import per_tensor_fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    calls = {
        "torch.mm bf16": lambda: torch.mm(x, w.t()),
        "torch.mm bf16, fp32 out": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
        "torch._scaled_mm, fast accumulation": lambda: torch._scaled_mm(
            x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
            use_fast_accum=True),
        "torch._scaled_mm, split accumulation": lambda: torch._scaled_mm(
            x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
            use_fast_accum=False),
        "minifloat current-scaling cast (both copies)": lambda:
            per_tensor_fp8.quantize_current_scaling(x, torch.float8_e4m3fn),
        "torch.empty x3 (a cast's outputs)": lambda: (
            torch.empty((m, k), dtype=torch.uint8, device="cuda"),
            torch.empty((k, m), dtype=torch.uint8, device="cuda"),
            torch.empty(1, dtype=torch.float32, device="cuda")),
    }
    if hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability() == (9, 0):
        groups = 8
        rows = max(16, m // groups * groups)
        xg = torch.randn(rows, k, device="cuda").to(torch.float8_e4m3fn)
        wg = torch.randn(groups, n, k, device="cuda").to(torch.float8_e4m3fn)
        offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * (rows // groups)
        row_scales = torch.ones(rows, device="cuda")
        column_scales = torch.ones(groups, n, device="cuda")
        calls["torch._scaled_grouped_mm, 8 groups"] = lambda: torch._scaled_grouped_mm(
            xg, wg.transpose(-2, -1), row_scales, column_scales, offs=offs,
            out_dtype=torch.bfloat16, use_fast_accum=True)
    calls.update(composed(x, w))
    return calls


def composed(x: torch.Tensor, w: torch.Tensor) -> dict:
    """Rows that compose the primitives as a Linear forward does, so that the cost of
    composition (calls run between other calls, not repeated alone) and of the module around
    it show apart: the FP8 forward's three calls inline; the same through the lean autograd
    Function; minifloat.Linear under autocast; and nn.Linear, all on the same operands.
    (On the ninth session's H100 host a cast cost 44 us alone and about 117 us inside the
    module's forward under cProfile.)"""
    import minifloat as mf
    from minifloat.gemm_paths import scaled_mm_bytes
    from minifloat.kernels import per_tensor_fp8

    def inline() -> torch.Tensor:
        x_data, _, x_scale_inv = per_tensor_fp8.quantize_current_scaling(
            x, torch.float8_e4m3fn, rowwise=True, columnwise=True)
        w_data, _, w_scale_inv = per_tensor_fp8.quantize_current_scaling(
            w, torch.float8_e4m3fn, rowwise=True, columnwise=True)
        return scaled_mm_bytes(x_data, w_data, x_scale_inv, w_scale_inv, out_dtype=x.dtype,
                               bias=None, fast_accumulation=True)

    n, k = w.shape
    recipe = mf.Float8CurrentScaling(fp8_format=mf.Format.E4M3)
    linear = mf.Linear(k, n, bias=False, params_dtype=x.dtype, device=x.device)
    plain = torch.nn.Linear(k, n, bias=False, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        linear.weight.copy_(w)
        plain.weight.copy_(w)
    x_grad = x.detach().clone().requires_grad_(True)

    def module_forward() -> torch.Tensor:
        with mf.autocast(recipe=recipe):
            return linear(x_grad)

    state = {}

    def module_forward_in_autocast() -> torch.Tensor:
        # one autocast for every repeat, as a step's forward enters it once; entered at this
        # row's first call and left open (the last row measured)
        if "context" not in state:
            state["context"] = mf.autocast(recipe=recipe)
            state["context"].__enter__()
        return linear(x_grad)

    return {
        "FP8 forward inline: cast x, cast w, _scaled_mm": inline,
        "minifloat.Linear forward, autocast entered per call": module_forward,
        "nn.Linear forward, bf16": lambda: plain(x_grad),
        "minifloat.Linear forward inside one autocast (last)": module_forward_in_autocast,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16x2048x2048", help="M x K x N")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_host: no CUDA device; skipped", file=sys.stderr)
        return 0
    from model_step import environment

    m, k, n = (int(value) for value in args.shape.split("x"))
    results = {"benchmark": "gemm_host", "shape": [m, k, n], **environment("cuda"),
               "host_us": {}}
    for name, call in primitives(m, k, n).items():
        results["host_us"][name] = host_us(call, args.repeats)
        print(f"{name:48s} {results['host_us'][name]:8.1f} us", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
