"""Where a training step's memory goes, phase by phase (issue 15: FP8 peaks above bf16).

Why: model_step.py reports one peak per row; to cut it one must know which phase sets it and
whether the first steps differ from later ones. For each row (the rows of model_step.py, same
model, same conversion) and each of the first --steps steps this prints, in GiB:

  start     allocated when the step starts (parameters, gradients, optimizer state)
  fwd_peak  peak during forward + loss
  saved     allocated after forward: start + what autograd keeps for backward
  bwd_peak  peak during backward
  opt_peak  peak during the optimizer step and zero_grad
  reserved  the caching allocator's reserved memory at the end of the step

Peaks are reset before each phase. Usage:
  python benchmarks/memory_probe.py --preset 1b --rows bf16-eager,fp8-current-eager [--steps 3]
      [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_step  # noqa: E402

PRESETS = model_step.PRESETS

GIB = 2**30


def _mark() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / GIB


def _peak_since_reset(reset: bool = True) -> float:
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GIB
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def probe_row(name: str, preset: str, steps: int) -> dict:
    """Phase-by-phase memory of the first `steps` steps of one row."""
    config = PRESETS[preset]
    spec = model_step.RowSpec.parse(name)
    batches = model_step.make_batches(config, steps, "cuda")
    torch.cuda.reset_peak_memory_stats()
    step = model_step.prepare_row(spec, model_step.build_model(config, "cuda"), "cuda",
                                  batches[0])
    result = {"row": name, "preset": preset, "build_peak": _peak_since_reset(), "steps": []}
    for tokens in batches:
        phases = {"start": _mark()}
        if step.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with model_step.recipe_context(step.recipe, step.graph_casts):
            loss = step.loss_fn(tokens)
        phases["fwd_peak"] = _peak_since_reset()
        phases["saved"] = _mark()
        loss.backward()
        phases["bwd_peak"] = _peak_since_reset()
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
        phases["opt_peak"] = _peak_since_reset()
        phases["reserved"] = torch.cuda.memory_reserved() / GIB
        result["steps"].append({key: round(value, 3) for key, value in phases.items()})
        print(f"{preset} {name} step {len(result['steps'])}: " + ", ".join(
            f"{key} {value:.2f}" for key, value in phases.items()), flush=True)
    del step, loss
    model_step._free("cuda")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="bf16-eager,fp8-current-eager")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_probe: needs CUDA; skipped", file=sys.stderr)
        return 0
    env = model_step.environment("cuda")
    rows = []
    for name in [n for n in args.rows.split(",") if n]:
        try:
            rows.append(probe_row(name, args.preset, args.steps))
        except Exception as error:  # noqa: BLE001 - recorded, the next row runs
            rows.append({"row": name, "error": model_step._error_text(error)})
            print(f"{name}: {rows[-1]['error']}", file=sys.stderr)
            model_step._free("cuda")
    out = args.out or model_step.RESULTS / f"memory_probe_{model_step.device_slug(env)}.json"
    out.write_text(json.dumps({"benchmark": "memory_probe", **env, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
