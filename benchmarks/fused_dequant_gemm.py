"""Fused Triton dequantize-GEMM against the library's decode + cuBLAS bf16 path (fprop GEMM).

The "GPU fast path" issue asks to measure, for MXFP8 and NVFP4 by exact emulation, a dequantize
kernel plus a cuBLAS bf16 GEMM against a fused Triton dequantize-GEMM, and keep the faster. Both
operands are pre-quantized (rowwise copies only; X as an input, W as a weight: NVFP4 2D); only
the GEMM call is timed, at the Linear benchmark's fprop shapes Y[M, N] = X[M, K] W[N, K]^T:

- current: minifloat.general_gemm(qx, qw, out_dtype=bf16) (two dequantize.py decodes, torch.mm;
  NVFP4: fp32 product, then kernels/epilogue.py applies alpha and casts), and its pieces;
- fused: kernels/fused_gemm.py, every decode variant, tiles tuned at --tune-shape;
- bf16: torch.mm on bf16 operands of the same shape (the speed of light for both).
Each fused result is checked against the current path's output at size (bf16 ulps).

Usage: python benchmarks/fused_dequant_gemm.py [--out DIR] [--shapes MxKxN,...]
       [--tune-shape MxKxN] [--budget SECONDS]
Times are medians of triton.testing.do_bench (device events); TFLOP/s = 2MNK / time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SHAPES = [(16384, 4096, 4096), (16384, 8192, 8192), (8192, 8192, 28672)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CANDIDATES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
              (256, 128, 64, 8, 3), (128, 128, 64, 4, 4)]
VARIANTS = {"mxfp8": ["lib", "cvt", "dot_scaled"], "nvfp4": ["lib", "bits"]}


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def operands(fmt: str, m: int, k: int, n: int):
    """Quantized X [M, K] (input) and W [N, K] (weight), rowwise copies only."""
    import minifloat as mf

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    if fmt == "mxfp8":
        quantizer = mf.MXFP8Quantizer(torch.float8_e4m3fn, rowwise=True, columnwise=False)
        qx, qw = quantizer(x), quantizer(w)
    else:
        qx = mf.NVFP4Quantizer(rowwise=True, columnwise=False)(x)
        qw = mf.NVFP4Quantizer(rowwise=True, columnwise=False, with_2d_quantization=True)(w)
    return x, w, qx, qw


def fused_call(fmt, qx, qw, decode, config):
    from minifloat import numerics
    from minifloat.kernels import fused_gemm as fg
    from minifloat.quantizers import as_storage

    a, b = as_storage(qx), as_storage(qw)
    if fmt == "mxfp8":
        args = (a.rowwise_data, a.rowwise_scale, b.rowwise_data, b.rowwise_scale)
        return lambda: fg.fused_mxfp8_gemm(*args, decode=decode, config=config)
    alpha = (numerics.global_decode_scale(a.amax_rowwise).float()
             * numerics.global_decode_scale(b.amax_rowwise).float())
    args = (a.rowwise_data, a.rowwise_scale, b.rowwise_data, b.rowwise_scale, alpha)
    return lambda: fg.fused_nvfp4_gemm(*args, decode=decode, config=config)


def precompile(calls) -> None:
    """Compile every (variant, tiles) kernel in parallel threads (Triton's AsyncCompileMode;
    warmup compiles without launching). Failures surface later, at the real call."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    from minifloat.kernels import fused_gemm as fg

    def warm(kernel, grid, *args, num_warps=4, options=None, **constexprs):
        kernel.warmup(*args, grid=grid, num_warps=num_warps, **(options or {}), **constexprs)

    saved, fg.launch = fg.launch, warm
    try:
        with ThreadPoolExecutor(16) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for call in calls:
                try:
                    call()
                except Exception as error:  # noqa: BLE001 - reported at the real call
                    print(f"  precompile: {error!r}"[:160])
    finally:
        fg.launch = saved


def ulp_check(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """bf16 ulps between two outputs (same sign region) and the share of differing values."""
    g, r = got.view(torch.int16).int(), ref.view(torch.int16).int()
    diff = (g - r).abs()
    return {"max_ulp": int(diff.max().item()), "mismatch": float((diff > 0).float().mean()),
            "nan_equal": bool(torch.equal(got.isnan(), ref.isnan()))}


def tune(fmt, shape, deadline, log) -> dict:
    """Best tiles per decode variant at one shape: {variant: (config, ms)}."""
    m, k, n = shape
    _, _, qx, qw = operands(fmt, m, k, n)
    calls = [fused_call(fmt, qx, qw, v, c) for v in VARIANTS[fmt] for c in CANDIDATES]
    started = time.time()
    precompile(calls)
    log(f"{fmt}: compiled {len(calls)} kernels in {time.time() - started:.0f} s")
    best = {}
    for variant in VARIANTS[fmt]:
        for config in CANDIDATES:
            if time.time() > deadline:
                log(f"{fmt}: tuning stopped at the time budget")
                return best
            try:
                ms = bench(fused_call(fmt, qx, qw, variant, config))
            except Exception as error:  # noqa: BLE001 - a variant that does not compile
                log(f"{fmt} {variant} {config}: FAILED {error!r}"[:200])
                continue
            log(f"{fmt} {variant:10s} {str(config):24s} {ms:8.3f} ms  "
                f"{2 * m * n * k / ms / 1e9:6.0f} TFLOP/s")
            if variant not in best or ms < best[variant][1]:
                best[variant] = (config, ms)
    return best


def measure(fmt, shape, best, rows, log) -> None:
    import minifloat as mf
    from minifloat.kernels.dequantize import (
        dequantize_mxfp8_bf16,
        dequantize_nvfp4_blocks_bf16,
    )
    from minifloat.kernels.epilogue import scale_bias_cast
    from minifloat.quantizers import as_storage

    m, k, n = shape
    flops = 2 * m * n * k
    x, w, qx, qw = operands(fmt, m, k, n)
    a, b = as_storage(qx), as_storage(qw)

    def row(path, ms, extra=None):
        rows.append({"format": fmt, "shape": [m, k, n], "path": path, "ms": ms,
                     "tflops": flops / ms / 1e9 if ms else 0.0, **(extra or {})})
        log(f"{fmt} {m}x{k}x{n} {path:34s} {ms:8.3f} ms")

    current = mf.general_gemm(qx, qw, out_dtype=torch.bfloat16)
    row("current general_gemm", bench(lambda: mf.general_gemm(qx, qw, out_dtype=torch.bfloat16)))
    if fmt == "mxfp8":
        da = dequantize_mxfp8_bf16(a.rowwise_data, a.rowwise_scale)
        db = dequantize_mxfp8_bf16(b.rowwise_data, b.rowwise_scale)
        row("  piece: decode A", bench(lambda: dequantize_mxfp8_bf16(a.rowwise_data,
                                                                      a.rowwise_scale)))
        row("  piece: decode B", bench(lambda: dequantize_mxfp8_bf16(b.rowwise_data,
                                                                      b.rowwise_scale)))
        row("  piece: torch.mm bf16 out", bench(lambda: torch.mm(da, db.t())))
    else:
        da = dequantize_nvfp4_blocks_bf16(a.rowwise_data, a.rowwise_scale)
        db = dequantize_nvfp4_blocks_bf16(b.rowwise_data, b.rowwise_scale)
        row("  piece: decode A", bench(lambda: dequantize_nvfp4_blocks_bf16(a.rowwise_data,
                                                                             a.rowwise_scale)))
        row("  piece: decode B", bench(lambda: dequantize_nvfp4_blocks_bf16(b.rowwise_data,
                                                                             b.rowwise_scale)))
        row("  piece: torch.mm fp32 out", bench(lambda: torch.mm(da, db.t(),
                                                                 out_dtype=torch.float32)))
        product = torch.mm(da, db.t(), out_dtype=torch.float32)
        alpha = torch.ones(1, device="cuda")
        row("  piece: epilogue alpha+cast", bench(lambda: scale_bias_cast(
            product, alpha, None, torch.bfloat16)))
        product = None
    da = db = None  # free the decoded operands before the fused runs
    row("bf16 torch.mm (reference speed)", bench(lambda: torch.mm(x, w.t())))
    for variant, (config, _) in best.items():
        call = fused_call(fmt, qx, qw, variant, config)
        try:
            check = ulp_check(call(), current)
            row(f"fused {variant} {config}", bench(call), check)
            log(f"    vs current: {check}")
        except Exception as error:  # noqa: BLE001
            log(f"fused {variant}: FAILED {error!r}"[:200])
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--tune-shape", default="16384x8192x8192")
    parser.add_argument("--formats", default="mxfp8,nvfp4")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds for tuning")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_dequant_gemm: no CUDA device; skipped", file=sys.stderr)
        return 0
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tune_shape = tuple(int(v) for v in args.tune_shape.split("x"))
    deadline = time.time() + args.budget

    def log(text):
        print(text, flush=True)

    rows, tuned = [], {}
    formats = args.formats.split(",")
    for fmt in formats:
        best = tune(fmt, tune_shape, deadline, log)
        tuned[fmt] = {v: {"config": list(c), "ms": ms} for v, (c, ms) in best.items()}
        torch.cuda.empty_cache()
        for shape in shapes:
            measure(fmt, shape, best, rows, log)
    device = torch.cuda.get_device_name()
    print(f"\n{device}, torch {torch.__version__}; ratio = fused / current (below 1: fused wins)")
    print(f"{'fmt':6s} {'M x K x N':>18s} {'path':44s} {'ms':>8s} {'TFLOP/s':>8s} {'ratio':>6s}")
    for r in rows:
        current = next(c["ms"] for c in rows if c["format"] == r["format"]
                       and c["shape"] == r["shape"] and c["path"].startswith("current"))
        ratio = f"{r['ms'] / current:6.2f}" if r["path"].startswith("fused") else ""
        print(f"{r['format']:6s} {'x'.join(map(str, r['shape'])):>18s} {r['path']:44s} "
              f"{r['ms']:8.3f} {r['tflops']:8.0f} {ratio:>6s}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_dequant_gemm.json").write_text(json.dumps(
            {"device": device, "torch": torch.__version__, "candidates": CANDIDATES,
             "tuned_at": list(tune_shape), "tuned": tuned, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
