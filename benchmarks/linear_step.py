"""Linear forward+backward per recipe against bf16, at the issue's three (M, K, N) shapes.

One step = y = x W^T, then dx and dW from an explicit dY (bf16 params and activations). The
minifloat step includes quantizing x, W (weights are quantized on every forward by default; the
step also clears the module's kept copies, so no is_first_microbatch reuse can sneak in) and
dY. Times are medians of device-event timings (triton do_bench).

Usage: python benchmarks/linear_step.py [--out DIR] [--recipes a,b] [--shapes MxKxN,...] [--torchao]
       [--cuda-graph fp8-current,...] [--rounds R]
(--cuda-graph: those recipes and bf16 also as captured CUDA graphs; --rounds: interleaved
rounds per shape, medians reported)
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


def bf16_step(m: int, k: int, n: int):
    layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer(x).backward(dy)

    return step


def torchao_step(m: int, k: int, n: int, recipe_name: str):
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

    return step


def minifloat_step(m: int, k: int, n: int, recipe):
    import minifloat as mf

    layer = mf.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        layer._weight_cache.clear()
        with mf.autocast(recipe=recipe):
            y = layer(x)
        y.backward(dy)

    return step


def _graphed(step):
    """The step captured as one CUDA graph (after a warm-up on a side stream): the same kernels
    without the host's Python, i.e. what the GPU alone needs. Gradients accumulate across
    replays as they do across eager steps. The returned replay keeps `step` (and so the tensors
    the graph uses) alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay():
        # `step` holds the layer, x and dY: the graph reads and writes their memory but does
        # not own it. Returning graph.replay alone let them be freed and reused by the next
        # step built, and replays then wrote into that memory (an illegal memory access).
        graph.replay()
        return step

    return replay


def step_for(name: str, m: int, k: int, n: int):
    """The step for "bf16", "torchao-tensorwise"/"torchao-rowwise" (None without torchao) or a
    minifloat recipe name (profile_step.py and host_profile.py time the same steps)."""
    if name == "bf16":
        return bf16_step(m, k, n)
    if name.startswith("torchao-"):
        return torchao_step(m, k, n, name.removeprefix("torchao-"))
    return minifloat_step(m, k, n, _recipes()[name])


def bf16_step_ms(m: int, k: int, n: int) -> float:
    return _bench(bf16_step(m, k, n))


def minifloat_step_ms(m: int, k: int, n: int, recipe, cuda_graph: bool = False) -> float:
    step = minifloat_step(m, k, n, recipe)
    return _bench(_graphed(step) if cuda_graph else step)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def time_interleaved(steps: dict, rounds: int, baseline: str = "bf16") -> list[dict]:
    """Time every step once per round, all steps in each round, and report per step the median
    time over rounds and the median of its per-round speed-up over `baseline`.

    Why rounds: the GPU's clocks drift over a run of minutes (heat, power), by several percent
    (the graphed bf16 step once timed 5% slower than the eager one in one run). Timing each
    step next to its baseline in every round and taking medians of the per-round ratios keeps
    that drift out of the ratios; the spread over rounds is reported alongside."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_bench(step))
    rows = []
    for name, values in times.items():
        ratios = [b / t for b, t in zip(times[baseline], values, strict=True)]
        rows.append({"recipe": name, "ms": _median(values), "ms_rounds": values,
                     "speedup": _median(ratios), "speedup_min": min(ratios),
                     "speedup_max": max(ratios)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--recipes", default=",".join(_recipes()))
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timing rounds per shape (medians reported)")
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
    recipes = {name: _recipes()[name] for name in args.recipes.split(",") if name}
    graphed = [name for name in args.cuda_graph.split(",") if name]
    rows = []
    for m, k, n in shapes:
        steps = {"bf16": bf16_step(m, k, n)}
        for name, recipe in recipes.items():
            steps[name] = minifloat_step(m, k, n, recipe)
        if graphed:
            steps["bf16-cuda-graph"] = _graphed(bf16_step(m, k, n))
            for name in graphed:
                steps[f"{name}-cuda-graph"] = _graphed(minifloat_step(m, k, n,
                                                                      _recipes()[name]))
        if args.torchao:
            for name in ("tensorwise", "rowwise"):
                step = torchao_step(m, k, n, name)
                if step is not None:
                    steps[f"torchao-{name}-compiled"] = step
        for row in time_interleaved(steps, args.rounds):
            rows.append({"shape": [m, k, n], **row})
        del steps
        torch.cuda.empty_cache()
    print(f"Linear fwd+bwd on {torch.cuda.get_device_name()} (torch {torch.__version__}), "
          f"medians of {args.rounds} interleaved rounds")
    print(f"{'M x K x N':>20s} {'recipe':>26s} {'ms':>9s} {'vs bf16':>8s} {'range':>13s}")
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        spread = f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}"
        print(f"{shape:>20s} {row['recipe']:>26s} {row['ms']:9.3f} {row['speedup']:8.2f} "
              f"{spread:>13s}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_step.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "rounds": args.rounds, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
