"""Per-tensor FP8 cast kernels timed on one GPU: single-tensor casts of the 1b preset's shapes
(bf16 both copies, rowwise only, an odd shape whose copies are stored in bytes, fp32 inputs)
and the multi-tensor casts of the 1b preset's 80 weights (the eager weight-cast batch's
per-allocation launch, delayed scaling's, and the flat-buffer launch), with a device copy of
the same bytes for scale.

Why: comparing two kernel versions needs the same rows from both source trees in one GPU
session, alternating, since the host and the GPU clocks vary between sessions:

    for i in 1 2; do
      PYTHONPATH=old/src python benchmarks/per_tensor_casts.py --label old$i --out old$i.json
      PYTHONPATH=src python benchmarks/per_tensor_casts.py --label new$i --out new$i.json
    done

Times are medians of triton.testing.do_bench (device events; launches included).
"""

from __future__ import annotations

import argparse
import json

import torch

E4M3 = torch.float8_e4m3fn
SINGLE_SHAPES = ((8192, 2048), (8192, 8192), (2048, 8192), (8190, 2050))
LAYER_SHAPES = ((6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192))  # qkv, proj, fc1, fc2


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def run() -> dict[str, float]:
    from minifloat.kernels import multi_tensor, multi_tensor_each, per_tensor_fp8

    torch.manual_seed(0)
    rows: dict[str, float] = {}
    scale = torch.tensor([2.0], device="cuda")
    amax = torch.zeros(1, device="cuda")
    for m, k in SINGLE_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        rows[f"current bf16 {m}x{k}"] = _bench(
            lambda x=x: per_tensor_fp8.quantize_current_scaling(x, E4M3))
        rows[f"delayed bf16 {m}x{k}"] = _bench(
            lambda x=x: per_tensor_fp8.quantize_delayed_scaling(x, scale, amax, E4M3))
        rows[f"current rowwise bf16 {m}x{k}"] = _bench(
            lambda x=x: per_tensor_fp8.quantize_current_scaling(x, E4M3, columnwise=False))
    x32 = torch.randn(8192, 2048, device="cuda")
    rows["current fp32 8192x2048"] = _bench(
        lambda: per_tensor_fp8.quantize_current_scaling(x32, E4M3))
    rows["delayed fp32 8192x2048"] = _bench(
        lambda: per_tensor_fp8.quantize_delayed_scaling(x32, scale, amax, E4M3))
    shapes = list(LAYER_SHAPES) * 20
    weights = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes]
    scales = [torch.tensor([1.5], device="cuda") for _ in shapes]
    amaxes = [torch.zeros(1, device="cuda") for _ in shapes]
    rows["multi current each 1b weights"] = _bench(
        lambda: multi_tensor_each.quantize_current_scaling_each(weights, E4M3))
    rows["multi delayed each 1b weights"] = _bench(
        lambda: multi_tensor_each.quantize_delayed_scaling_each(weights, E4M3, scales, amaxes))
    rows["multi current stacked 1b weights"] = _bench(
        lambda: multi_tensor.quantize_current_scaling_stacked(weights, E4M3))
    small = [torch.randn(shape, device="cuda", dtype=torch.bfloat16)
             for shape in [(64, 512), (128, 512), (96, 1024)] * 8]
    rows["multi current stacked 24 small"] = _bench(
        lambda: multi_tensor.quantize_current_scaling_stacked(small, E4M3))
    source = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    rows["copy bf16 8192x8192"] = _bench(lambda: target.copy_(source))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", help="write {label, ms} as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("per_tensor_casts: needs a CUDA GPU")
    rows = run()
    for name, ms in rows.items():
        print(f"{args.label} {name}: {ms:.4f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"label": args.label, "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
