"""Linear forward+backward per recipe against bf16, at the issue's three (M, K, N) shapes.

One step = y = x W^T, then dx and dW from an explicit dY (bf16 params and activations). The
minifloat step includes quantizing x, W (weights are quantized on every forward by default; the
step also clears the module's kept copies, so no is_first_microbatch reuse can sneak in) and
dY. Times are medians of device-event timings (triton do_bench).

Usage: python benchmarks/linear_step.py [--out DIR] [--recipes a,b] [--shapes MxKxN,...] [--torchao]
       [--cuda-graph fp8-current,...]   (those recipes and bf16 also as captured CUDA graphs)
(torchao 0.18.0 travels to the offline GPU machine as a wheel: see BENCHMARKS.md.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHAPES = [(16384, 4096, 4096), (16384, 8192, 8192), (8192, 8192, 28672)]


def _recipes():
    import minifloat as mf

    return {
        "fp8-current": mf.Float8CurrentScaling(),
        "fp8-delayed": mf.DelayedScaling(),
        "fp8-block": mf.Float8BlockScaling(),
        "mxfp8": mf.MXFP8BlockScaling(),
        "nvfp4": mf.NVFP4BlockScaling(),
    }


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def bf16_step_ms(m: int, k: int, n: int) -> float:
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x).backward(dy)

    return _bench(step)


def torchao_step_ms(m: int, k: int, n: int, recipe_name: str) -> float | None:
    """torchao.float8 training Linear (tensorwise or rowwise) under torch.compile, or None."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    model = torch.nn.Sequential(
        torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe_name))
    model = torch.compile(model)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        model(x).backward(dy)

    return _bench(step)


def minifloat_step_ms(m: int, k: int, n: int, recipe, cuda_graph: bool = False) -> float:
    import minifloat as mf

    layer = mf.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer._weight_cache.clear()
        with mf.autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)

    return _bench(_graphed(step) if cuda_graph else step)


def _graphed(step):
    """The step captured as one CUDA graph (after a warm-up on a side stream): the same kernels
    without the host's Python, i.e. what the GPU alone needs. Gradients accumulate across
    replays as they do across eager steps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def bf16_graphed_step_ms(m: int, k: int, n: int) -> float:
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return _bench(_graphed(lambda: layer(x).backward(dy)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--recipes", default=",".join(_recipes()))
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--torchao", action="store_true",
                        help="also time torchao.float8 tensorwise/rowwise under torch.compile")
    parser.add_argument("--cuda-graph", default="",
                        help="comma-separated recipes also timed as CUDA graphs (with bf16)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("linear_step: no CUDA device; skipped", file=sys.stderr)
        return 0
    shapes = SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    recipes = {name: _recipes()[name] for name in args.recipes.split(",")}
    rows = []
    for m, k, n in shapes:
        base = bf16_step_ms(m, k, n)
        rows.append({"shape": [m, k, n], "recipe": "bf16", "ms": base, "speedup": 1.0})
        for name, recipe in recipes.items():
            ms = minifloat_step_ms(m, k, n, recipe)
            rows.append({"shape": [m, k, n], "recipe": name, "ms": ms, "speedup": base / ms})
        graphed = [name for name in args.cuda_graph.split(",") if name]
        if graphed:
            graph_base = bf16_graphed_step_ms(m, k, n)
            rows.append({"shape": [m, k, n], "recipe": "bf16-cuda-graph", "ms": graph_base,
                         "speedup": base / graph_base})
            for name in graphed:
                ms = minifloat_step_ms(m, k, n, _recipes()[name], cuda_graph=True)
                rows.append({"shape": [m, k, n], "recipe": f"{name}-cuda-graph", "ms": ms,
                             "speedup": base / ms, "speedup_vs_graphed_bf16": graph_base / ms})
        if args.torchao:
            for name in ("tensorwise", "rowwise"):
                ms = torchao_step_ms(m, k, n, name)
                if ms is not None:
                    rows.append({"shape": [m, k, n], "recipe": f"torchao-{name}-compiled",
                                 "ms": ms, "speedup": base / ms})
        torch.cuda.empty_cache()
    print(f"Linear fwd+bwd on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"{'M x K x N':>20s} {'recipe':>26s} {'ms':>9s} {'vs bf16':>8s}")
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        print(f"{shape:>20s} {row['recipe']:>26s} {row['ms']:9.3f} {row['speedup']:8.2f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_step.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
            indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
