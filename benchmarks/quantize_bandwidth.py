"""Quantize kernels on a 16384x8192 bf16 input, as bandwidth against the device copy bandwidth.

Each format is timed through its public quantizer (both copies, as a training step asks for
them), so the figure includes the Python dispatch a user pays. The floor of each is the fewest
bytes it must move: one read of the input plus every output byte, and a second read of the input
where the format needs a global amax before it can scale (current-scaling FP8, NVFP4). The copy
bandwidth is measured in the same run as (read + write bytes) / time of a same-size bf16
device-to-device copy_. Reported ratio = (floor bytes / time) / copy bandwidth.

Usage: python benchmarks/quantize_bandwidth.py [--out DIR] [--rows R --cols C | --shapes RxC,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _bench(fn) -> float:
    """Median milliseconds of fn over device events (triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _quantizers():
    import minifloat as mf

    return {
        # name: (quantizer, output bytes per element both copies, extra input reads)
        "fp8-current E4M3 (row+col)": (mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
                                       2.0, 1),
        "fp8-delayed E4M3 (row+col)": (mf.Float8Quantizer(
            torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"), torch.float8_e4m3fn),
            2.0, 0),
        "block-fp8 1x128 (row+col)": (mf.Float8BlockQuantizer(1), 2.0 + 8 / 128, 0),
        "block-fp8 128x128 (row+col)": (mf.Float8BlockQuantizer(2), 2.0, 0),
        "mxfp8 E4M3 (row+col)": (mf.MXFP8Quantizer(torch.float8_e4m3fn), 2.0 + 2 / 32, 0),
        "nvfp4 1x16 (row + col RHT)": (mf.NVFP4Quantizer(with_rht=True), 1.0 + 2 / 16, 1),
        "nvfp4 16x16 (row+col)": (mf.NVFP4Quantizer(with_2d_quantization=True),
                                  1.0 + 2 / 16, 1),
        "nvfp4 1x16 SR (row+col)": (mf.NVFP4Quantizer(stochastic_rounding=True),
                                    1.0 + 2 / 16, 1),
    }


def run(rows: int, cols: int) -> dict:
    from minifloat import kernels

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    if not kernels.available(x):
        raise SystemExit("quantize_bandwidth: Triton kernels are not available on this machine")
    elements = x.numel()
    copy_target = torch.empty_like(x)
    copy_ms = _bench(lambda: copy_target.copy_(x))
    copy_bandwidth = 2 * elements * x.element_size() / (copy_ms * 1e-3)
    results = {"shape": [rows, cols], "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "copy_ms": copy_ms,
               "copy_bandwidth_GBps": copy_bandwidth / 1e9, "formats": {}}
    from minifloat.kernels import per_tensor_fp8

    rows_to_time = [(name, spec, {}) for name, spec in _quantizers().items()]
    current = rows_to_time[0][1]
    # the same current-scaling cast in two launches (amax partials, then the cast), as before
    # the one-launch kernel: the GPU-time cost or gain of its grid barrier, measured here; and
    # the one-launch kernel with its cast pass in the amax pass's order (no L2 reuse)
    rows_to_time[1:1] = [
        ("fp8-current E4M3 two launches", current, {"ONE_LAUNCH": False}),
        ("fp8-current E4M3 cast in amax order", current, {"ONE_LAUNCH_CAST_REVERSED": False})]
    for name, (quantizer, out_bytes, extra_reads), overrides in rows_to_time:
        quantizer.internal = True
        saved = {key: getattr(per_tensor_fp8, key) for key in overrides}
        for key, value in overrides.items():
            setattr(per_tensor_fp8, key, value)
        try:
            ms = _bench(lambda q=quantizer: q(x))
        finally:
            for key, value in saved.items():
                setattr(per_tensor_fp8, key, value)
        floor_bytes = elements * (x.element_size() * (1 + extra_reads) + out_bytes)
        bandwidth = floor_bytes / (ms * 1e-3)
        results["formats"][name] = {
            "ms": ms, "floor_bytes": floor_bytes, "input_reads": 1 + extra_reads,
            "bandwidth_GBps": bandwidth / 1e9, "fraction_of_copy": bandwidth / copy_bandwidth,
        }
    return results


def print_table(results: dict) -> None:
    print(f"quantize {results['shape']} bf16 on {results['device']} (torch {results['torch']}); "
          f"copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s")
    print(f"{'format':36s} {'ms':>8s} {'reads':>5s} {'GB/s':>8s} {'x copy':>7s}")
    for name, row in results["formats"].items():
        print(f"{name:36s} {row['ms']:8.3f} {row['input_reads']:5d} "
              f"{row['bandwidth_GBps']:8.0f} {row['fraction_of_copy']:7.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--shapes", default=None,
                        help="comma list of RxC shapes instead of --rows/--cols, e.g. "
                             "8192x2048,8192x8192 (the 1b preset's layer inputs); one JSON each")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("quantize_bandwidth: no CUDA device; skipped", file=sys.stderr)
        return 0
    shapes = ([tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
              if args.shapes else [(args.rows, args.cols)])
    for rows, cols in shapes:
        results = run(rows, cols)
        print_table(results)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            name = ("quantize_bandwidth.json" if args.shapes is None
                    else f"quantize_bandwidth_{rows}x{cols}.json")
            (args.out / name).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
