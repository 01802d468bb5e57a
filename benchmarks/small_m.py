"""Small-M GEMMs in inference: the quantized path against bf16 with the dequantized weight
(issue 21: "at small M, the GEMM runs where it is fastest, chosen by rule and documented").

Why: in generation a decode step multiplies M = batch tokens (often 1-16) by each weight. The
quantized path quantizes the activation and runs a scaled GEMM (or, for MXFP8/NVFP4 on Hopper,
dequantizes and runs a bf16 GEMM); a bf16 GEMM with the weight dequantized once per generation
skips the activation's cast. Which wins depends on M, the shape and the recipe, and only a GPU
can say; this script measures the crossover that the rule is to be taken from.

For each --shape KxN and M in --ms, each row times one forward under torch.no_grad():
  bf16         F.linear(x, W) in bf16 (= the dequantized-weight path's GEMM)
  <recipe>     minifloat.Linear under autocast(recipe) and quantize_weights_once(small_m_rows=0)
               (the weight quantized once, outside the timing; the recipe's quantized GEMM)
  <recipe>-rule  the same under quantize_weights_once()'s default small-M rule (calls of at
               most SMALL_M_ROWS rows against the weight dequantized once: what a generation
               pays per call)
device_ms: triton.testing.do_bench median (on the CPU: perf_counter median, a smoke test);
host_us: median host time of one call, the GPU queue drained before (perf_counter around the
call, no synchronize inside), median over rounds. Every M times all rows in --rounds
interleaved rounds; the speed-up is the median over rounds of bf16's time over the row's.

Usage: python benchmarks/small_m.py [--shape 2048x2048,2048x8192] [--ms 1,2,4,8,16,32,64,128,256]
       [--recipes fp8-current,fp8-delayed,mxfp8,nvfp4] [--rounds 3] [--device cuda|cpu]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_step import RESULTS, device_slug, environment, minifloat_recipe  # noqa: E402

from minifloat.modules.weights import SMALL_M_ROWS  # noqa: E402

RULE = "-rule"


def device_ms(fn, device: str) -> float:
    if device.startswith("cuda"):
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def host_us(fn, device: str, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def measure_shape(k: int, n: int, ms: list[int], recipes: list[str], rounds: int,
                  device: str, dtype: torch.dtype) -> list[dict]:
    import minifloat as mf

    torch.manual_seed(0)
    layer = mf.Linear(k, n, bias=False, params_dtype=dtype, device=device)
    weight = layer.weight.detach()
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=dtype)
        names = ["bf16", *recipes, *(f"{name}{RULE}" for name in recipes)]
        times: dict[str, list[float]] = {name: [] for name in names}
        hosts: dict[str, list[float]] = {name: [] for name in times}
        for _ in range(rounds):
            with torch.no_grad():
                times["bf16"].append(device_ms(lambda x=x: F.linear(x, weight), device))
                hosts["bf16"].append(host_us(lambda x=x: F.linear(x, weight), device))
                for name in recipes:
                    for row, limit in ((name, 0), (f"{name}{RULE}", SMALL_M_ROWS)):
                        with mf.autocast(recipe=minifloat_recipe(name)), \
                                mf.quantize_weights_once(small_m_rows=limit):
                            layer(x)  # the weight's quantization, once
                            times[row].append(device_ms(lambda x=x: layer(x), device))
                            hosts[row].append(host_us(lambda x=x: layer(x), device))
        for name, values in times.items():
            ratios = [b / t for b, t in zip(times["bf16"], values, strict=True)]
            rows.append({"k": k, "n": n, "m": m, "row": name,
                         "device_ms": statistics.median(values),
                         "host_us": statistics.median(hosts[name]),
                         "speedup_vs_bf16": statistics.median(ratios)})
            print(f"K={k} N={n} M={m:4d} {name:12s} {rows[-1]['device_ms']:.4f} ms  "
                  f"host {rows[-1]['host_us']:7.1f} us  {rows[-1]['speedup_vs_bf16']:.2f}x bf16",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048x2048,2048x8192", help="KxN list")
    parser.add_argument("--ms", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--recipes", default="fp8-current,fp8-delayed,mxfp8,nvfp4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("small_m: no CUDA device; skipped (--device cpu for a smoke run)", file=sys.stderr)
        return 0
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    env = environment(args.device)
    rows = []
    for shape in args.shape.split(","):
        k, n = (int(v) for v in shape.split("x"))
        rows += measure_shape(k, n, [int(m) for m in args.ms.split(",")],
                              args.recipes.split(","), args.rounds, args.device, dtype)
    out = args.out or RESULTS / f"small_m_{device_slug(env)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "small_m", **env, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
