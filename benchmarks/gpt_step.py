"""minifloat's lab GPT per recipe against plain PyTorch: training steps in one process.

Why this changed (issue 15): this script used to time minifloat's own GPT without a recipe as
"bf16". That baseline ran minifloat's modules (Python around every GEMM) and said nothing of
what plain PyTorch does. The baselines are now the plain-PyTorch model of the same shape
(minifloat.models.torch_gpt, run by model_step.py's code): bf16 eager, bf16 torch.compile and
torchao float8 tensorwise compiled, plus a plain bf16 step captured as a CUDA graph when graph
rows run, and a plain bf16 eager step with single-thread backward when those rows run. Each
ratio then compares a minifloat row with the plain row of the same kind (vs bf16 eager, vs
bf16 compiled, vs bf16 graph).

The minifloat rows run the lab GPT (minifloat.models.gpt: LayerNormLinear, LayerNormMLP and
Linear, the LM head included, as `python -m minifloat compare` trains it) under each recipe
spec: eager (`lab-<spec>-eager`), eager with autograd's device thread off
(`lab-<spec>-eager-1t`) and as one captured CUDA graph (`lab-<spec>-cuda-graph`). `lab-bf16-*`
is the lab GPT without a recipe: kept to show what minifloat's modules cost by themselves, not
as a baseline. For minifloat.convert_model on the plain model (the LM head kept in bf16) run
model_step.py.

One step = forward, cross-entropy loss, backward, fused AdamW step, zero_grad (gradient clipping,
which the old script did, is gone: plain PyTorch rows do not clip either). Measurements, warm-up
and the JSON rows are model_step.py's (see its docstring): median ms/step by CUDA events, host
ms, kernels per step, peak memory, the 16-token forward+backward host time of eager rows.

Usage: python benchmarks/gpt_step.py [--presets 1b,small] [--recipes bf16,fp8-current,...]
       [--steps 10] [--warmup 3] [--cuda-graph off|on|both] [--single-thread-backward off|on|both]
       [--baselines bf16-eager,bf16-compiled,torchao-tensorwise-compiled] [--out DIR]
Recipe names are those of `python -m minifloat compare --recipes help` (hybrids included).
Writes DIR/gpt_step.json (benchmarks/tables.py renders it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_step  # noqa: E402
import tables  # noqa: E402

from minifloat.models.torch_gpt import PRESETS as PLAIN_PRESETS  # noqa: E402

DEFAULT_RECIPES = "bf16,fp8-current,fp8-delayed,fp8-block,mxfp8,nvfp4,hybrid:mxfp8/nvfp4"
DEFAULT_BASELINES = "bf16-eager,bf16-compiled,torchao-tensorwise-compiled"


def lab_step(preset: str, spec: str, device: str, graphed: bool) -> model_step.TrainStep:
    """The lab GPT of `preset` (bf16, same seed as the plain rows) under the recipe `spec`."""
    from minifloat.lab.recipe_specs import parse_recipe
    from minifloat.models.gpt import GPT, PRESETS

    config = PRESETS[preset]
    torch.manual_seed(model_step.SEED)
    model = GPT(config, dtype=torch.bfloat16, device=device)
    return model_step.TrainStep(model, model.loss,
                                model_step.make_optimizer(model, capturable=graphed),
                                recipe=parse_recipe(spec, config.n_layers))


def plain_step(preset: str, device: str, graphed: bool) -> model_step.TrainStep:
    """The plain bf16 model's eager step (the baseline of the graph and single-thread rows)."""
    model = model_step.build_model(PLAIN_PRESETS[preset], device)
    return model_step.TrainStep(model, model.loss,
                                model_step.make_optimizer(model, capturable=graphed))


def capture(step: model_step.TrainStep, example: torch.Tensor,
            warmup: int = 3) -> Callable[[torch.Tensor], torch.Tensor]:
    """The whole training step as one CUDA graph; the returned replay(tokens) copies the batch
    into the graph's input and replays it (no Python per kernel), returning the loss tensor.

    Warm-up runs on a side stream, as torch.cuda.graph asks; gradients are set to None before
    the capture so backward allocates them from the graph's pool and every replay writes them
    afresh. minifloat's weight caches are cleared so each weight's quantization is captured (a
    cache hit at capture time would freeze last step's quantized weight into the graph)."""
    static = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    step.optimizer.zero_grad(set_to_none=True)
    for module in step.model.modules():
        cache = getattr(module, "_weight_cache", None)
        if cache is not None:
            cache.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(static, zero_grad=False)

    def replay(tokens: torch.Tensor) -> torch.Tensor:
        # `step` and `static` stay referenced here: the graph uses their memory, not owns it
        static.copy_(tokens)
        graph.replay()
        return loss

    replay.keep = (graph, step, static)  # type: ignore[attr-defined]
    return replay


def rows_for_mode(preset: str, mode: str, recipes: list[str], baselines: list[str],
                  batches: list[torch.Tensor], host16: torch.Tensor, steps: int, warmup: int,
                  device: str) -> list[dict]:
    """Rows of one mode: eager (plain baselines first), eager-1t or cuda-graph."""
    graphed = mode == "cuda-graph"
    builds: list[tuple[str, Callable]] = []
    if mode == "eager":
        for name in baselines:
            spec = model_step.RowSpec.parse(name)
            builds.append((name, lambda spec=spec: model_step.prepare_row(
                spec, model_step.build_model(PLAIN_PRESETS[preset], device), device)))
    elif mode == "eager-1t":
        builds.append(("bf16-eager-1t", lambda: plain_step(preset, device, False)))
    else:
        builds.append(("bf16-cuda-graph",
                       lambda: capture(plain_step(preset, device, True), batches[0])))
    for spec in recipes:
        if graphed:
            def build(spec: str = spec) -> Callable:
                return capture(lab_step(preset, spec, device, True), batches[0])
        else:
            def build(spec: str = spec) -> model_step.TrainStep:
                return lab_step(preset, spec, device, False)
        builds.append((f"lab-{spec}-{mode}", build))
    rows = []
    threads = (torch.autograd.set_multithreading_enabled(False) if mode == "eager-1t"
               else contextlib.nullcontext())
    with threads:
        for name, build in builds:
            row = {"preset": preset, "mode": mode, **model_step.run_row(
                name, build, batches, warmup, steps, device, host16)}
            rows.append(row)
            print(tables.model_step_line(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="1b,small")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES)
    parser.add_argument("--baselines", default=DEFAULT_BASELINES,
                        help="plain-PyTorch rows of model_step.py timed first")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cuda-graph", choices=("off", "on", "both"), default="both",
                        help="time eager steps, CUDA-graphed steps, or both (default)")
    parser.add_argument("--single-thread-backward", choices=("off", "on", "both"), default="off",
                        help="eager steps also (on: instead) with autograd's device thread off")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (no graphs)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpt_step: no CUDA device; skipped", file=sys.stderr)
        return 0
    # Why single-thread backward: on CUDA, autograd runs backward on a device thread of its
    # own; minifloat's backward is Python (autograd.Function), so each one hands the GIL to that
    # thread and back. The effect on the GPT models was mixed (BENCHMARKS.md), so it is
    # measured here, not recommended.
    modes = []
    if args.cuda_graph != "on":
        modes += {"off": ["eager"], "on": ["eager-1t"], "both": ["eager", "eager-1t"]}[
            args.single_thread_backward]
    if args.cuda_graph != "off" and device.startswith("cuda"):
        modes.append("cuda-graph")
    if "eager" not in modes:  # the ratios need the plain eager and compiled baselines
        modes.insert(0, "eager")
    recipes = [spec for spec in args.recipes.split(",") if spec]
    baselines = [name for name in args.baselines.split(",") if name]
    presets = [name for name in args.presets.split(",") if name]
    env = model_step.environment(device)
    rows = []
    for preset in presets:
        config = PLAIN_PRESETS[preset]
        batches = model_step.make_batches(config, args.warmup + 2 * args.steps + 1, device)
        host16 = model_step.make_batches(config, 1, device, seed=model_step.SEED + 1, batch=1,
                                         seq=model_step.HOST16_TOKENS)[0]
        for mode in modes:
            rows += rows_for_mode(preset, mode, recipes, baselines, batches, host16,
                                  args.steps, args.warmup, device)
    model_step.add_ratios(rows, {"bf16_eager": "bf16-eager", "bf16_compiled": "bf16-compiled",
                                 "bf16_graph": "bf16-cuda-graph"})
    data = {"benchmark": "gpt_step", **env, "dtype": "bfloat16", "steps": args.steps,
            "warmup": args.warmup, "host16_tokens": model_step.HOST16_TOKENS,
            "configs": {name: {**asdict(PLAIN_PRESETS[name]),
                               "parameters": PLAIN_PRESETS[name].parameter_count()}
                        for name in presets},
            "notes": ["lab-* rows: minifloat.models.gpt (minifloat modules, LM head "
                      "quantized too); plain rows: minifloat.models.torch_gpt"], "rows": rows}
    print()
    print(tables.model_step_table(data))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpt_step.json").write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
