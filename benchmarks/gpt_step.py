"""GPT training step per recipe: tokens/s against bf16 (issue part c).

One step = forward, loss, backward, gradient clipping and a fused AdamW step on the GPT of
minifloat.models (bf16 parameters), on random byte tokens (the data does not change the work).
Each recipe builds a fresh model from the same seed, runs warm-up steps (Triton compiles, the
allocator settles), then times `--steps` steps between two device synchronisations. bf16 runs
in the same process, so every ratio comes from one run.

Usage: python benchmarks/gpt_step.py [--presets 1b,small] [--recipes bf16,fp8-current,...]
       [--steps 10] [--out DIR]
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


def tokens_per_second(preset: str, spec: str, steps: int) -> dict:
    """Time `steps` training steps of a fresh model of `preset` under the recipe `spec`."""
    import minifloat as mf
    from minifloat.lab.recipe_specs import parse_recipe
    from minifloat.models.gpt import GPT, PRESETS, VOCAB_SIZE

    config = PRESETS[preset]
    recipe = parse_recipe(spec, config.n_layers)
    torch.manual_seed(0)
    model = GPT(config, dtype=torch.bfloat16, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.randint(0, VOCAB_SIZE, (config.batch_size, config.seq_len + 1),
                          device="cuda", generator=generator)

    def step() -> torch.Tensor:
        with mf.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "preset": preset, "recipe": spec, "steps": steps,
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpt_step: no CUDA device; skipped", file=sys.stderr)
        return 0
    rows = []
    for preset in args.presets.split(","):
        baseline = None
        for spec in args.recipes.split(","):
            row = tokens_per_second(preset, spec, args.steps)
            gc.collect()  # the last recipe's model and optimizer state go before the next
            torch.cuda.empty_cache()
            if spec == "bf16":
                baseline = row["tokens_per_s"]
            row["vs_bf16"] = row["tokens_per_s"] / baseline if baseline else None
            rows.append(row)
            ratio = "" if row["vs_bf16"] is None else f"{row['vs_bf16']:6.2f}x"
            print(f"{preset:>6s} {spec:>22s} {row['step_ms']:9.2f} ms/step "
                  f"{row['tokens_per_s']:12.0f} tokens/s {ratio} "
                  f"(loss {row['final_loss']:.3f}, peak {row['peak_memory_gib']:.1f} GiB)",
                  flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpt_step.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
