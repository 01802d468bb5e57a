"""GPT training step per recipe: tokens/s against bf16 (issue part c).

One step = forward, loss, backward, gradient clipping and a fused AdamW step on the GPT of
minifloat.models (bf16 parameters), on random byte tokens (the data does not change the work).
Each recipe builds a fresh model from the same seed, runs warm-up steps (Triton compiles, the
allocator settles), then times `--steps` steps between two device synchronisations. bf16 runs
in the same process, so every ratio comes from one run.

Eager steps pay minifloat's Python per module (tens of launches, each through Python); a CUDA
graph of the whole step (`--cuda-graph on|both`) replays the same kernels without it, which is
how host-bound models (small layers) are best run.

Usage: python benchmarks/gpt_step.py [--presets 1b,small] [--recipes bf16,fp8-current,...]
       [--steps 10] [--cuda-graph off|on|both] [--out DIR]
Recipe names are those of `python -m minifloat compare --recipes help` (hybrids included).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

DEFAULT_RECIPES = "bf16,fp8-current,fp8-delayed,fp8-block,mxfp8,nvfp4,hybrid:mxfp8/nvfp4"
WARMUP_STEPS = 3


def _capture(step, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """The whole training step captured as one CUDA graph (replayed without any Python).

    Warm-up runs on a side stream, as torch.cuda.graph asks; gradients are set to None before
    the capture so backward allocates them from the graph's pool, and every replay writes them
    afresh. Weight caches are cleared so each weight's quantization is captured (a cache hit at
    capture time would freeze last step's quantized weight into the graph).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            step(zero_grad=True)
    torch.cuda.current_stream().wait_stream(side)
    optimizer.zero_grad(set_to_none=True)
    for module in model.modules():
        cache = getattr(module, "_weight_cache", None)
        if cache is not None:
            cache.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(zero_grad=False)
    return graph, loss


def tokens_per_second(preset: str, spec: str, steps: int, cuda_graph: bool = False,
                      single_thread_backward: bool = False) -> dict:
    """Time `steps` training steps of a fresh model of `preset` under the recipe `spec`
    (eagerly, or as one CUDA graph replayed per step). `single_thread_backward` runs backward
    on the calling thread (torch.autograd.set_multithreading_enabled(False)), see main()."""
    import minifloat as mf
    from minifloat.lab.recipe_specs import parse_recipe
    from minifloat.models.gpt import GPT, PRESETS, VOCAB_SIZE

    config = PRESETS[preset]
    recipe = parse_recipe(spec, config.n_layers)
    torch.manual_seed(0)
    model = GPT(config, dtype=torch.bfloat16, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True,
                                  capturable=cuda_graph)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.randint(0, VOCAB_SIZE, (config.batch_size, config.seq_len + 1),
                          device="cuda", generator=generator)

    def step(zero_grad: bool = True) -> torch.Tensor:
        with mf.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        return loss

    if cuda_graph:
        graph, loss = _capture(step, model, optimizer)
        run = graph.replay
    else:
        run = step
    with torch.autograd.set_multithreading_enabled(not single_thread_backward):
        for _ in range(WARMUP_STEPS):
            run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            returned = run()  # a replay returns None: the captured loss tensor holds the value
            if not cuda_graph:
                loss = returned
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    result = {
        "preset": preset, "recipe": spec, "steps": steps, "cuda_graph": cuda_graph,
        "single_thread_backward": single_thread_backward,
        "step_ms": seconds / steps * 1e3,
        "tokens_per_s": config.tokens_per_step * steps / seconds,
        "final_loss": float(loss.item()),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="1b,small")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cuda-graph", choices=("off", "on", "both"), default="both",
                        help="time eager steps, CUDA-graphed steps, or both (default)")
    parser.add_argument("--single-thread-backward", choices=("off", "on", "both"), default="off",
                        help="eager steps also (on: only) with autograd's device threads off")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpt_step: no CUDA device; skipped", file=sys.stderr)
        return 0
    # Why single-thread backward: on CUDA, autograd runs backward on a device thread of its
    # own; minifloat's backward is Python (autograd.Function), so each one hands the GIL to that
    # thread and back. A scratch timing of one 256^3 FP8 Linear step on an H200 measured 1282 us
    # of host time with that thread and 778 us without; on the GPT models the effect was mixed
    # (BENCHMARKS.md), so it is measured here, not recommended.
    graph_modes = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    thread_modes = {"off": [False], "on": [True], "both": [False, True]}[
        args.single_thread_backward]
    modes = [(graphed, single) for graphed in graph_modes
             for single in (thread_modes if not graphed else [False])]
    rows = []
    for preset in args.presets.split(","):
        for graphed, single in modes:
            baseline = None
            for spec in args.recipes.split(","):
                row = _measure(preset, spec, args.steps, graphed, single)
                if spec == "bf16":
                    baseline = row["tokens_per_s"]
                row["vs_bf16"] = (row["tokens_per_s"] / baseline
                                  if baseline and "error" not in row else None)
                rows.append(row)
                _print_row(row)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpt_step.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "rows": rows}, indent=2))
    return 0


def _measure(preset: str, spec: str, steps: int, graphed: bool, single: bool) -> dict:
    """One row; a failure (e.g. a capture error) is recorded, not raised, so the table stays."""
    try:
        return tokens_per_second(preset, spec, steps, graphed, single)
    except Exception as error:  # noqa: BLE001 - reported in the table and the JSON
        return {"preset": preset, "recipe": spec, "cuda_graph": graphed,
                "single_thread_backward": single,
                "error": f"{type(error).__name__}: {error}"[:300]}
    finally:
        gc.collect()  # the last recipe's model and optimizer state go before the next
        torch.cuda.empty_cache()


def _print_row(row: dict) -> None:
    mode = "graph" if row["cuda_graph"] else (
        "eager-1t" if row.get("single_thread_backward") else "eager")
    if "error" in row:
        print(f"{row['preset']:>6s} {mode} {row['recipe']:>22s} failed: {row['error']}",
              flush=True)
        return
    ratio = "" if row["vs_bf16"] is None else f"{row['vs_bf16']:6.2f}x"
    print(f"{row['preset']:>6s} {mode} {row['recipe']:>22s} {row['step_ms']:9.2f} ms/step "
          f"{row['tokens_per_s']:12.0f} tokens/s {ratio} "
          f"(loss {row['final_loss']:.3f}, peak {row['peak_memory_gib']:.1f} GiB)", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
