"""Run the benchmarks, writing JSON under --out (scripts/gpu-check calls this).

Order: quantize bandwidth, the Linear step (with torchao and CUDA graphs), the MoE grouped
GEMMs on device offsets (grouped_gemm_bench.py, against torch's grouped kernels), then the
model step against plain PyTorch (model_step.py, issue 15):
- presets 1b and small, the default rows (plain bf16 eager, graphed and compiled, torchao
  tensorwise compiled, each minifloat recipe eager, graphed and compiled with reduce-overhead)
  -> model_step.json;
- llama-block, the plain rows, torchao and FP8 current eager, graphed and reduce-overhead ->
  model_step_llama_block.json.
The model steps are budgeted at about 8 minutes of GPU time together. Most of it is
torch.compile (tens of seconds per compiled row of 1b), not the timed steps, so the model steps
run MODEL_STEPS timed steps (and as many host-timed ones) after MODEL_WARMUP warm-up steps,
enough for a stable median at 1b (~0.1 s a step) while keeping the run inside the budget.

--gpt-step also runs gpt_step.py (minifloat's lab GPT, eager and CUDA graph, against the same
plain baselines; several more minutes), which earlier versions of this script always ran.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt_step  # noqa: E402
import grouped_gemm_bench  # noqa: E402
import linear_step  # noqa: E402
import model_step  # noqa: E402
import quantize_bandwidth  # noqa: E402

MODEL_STEPS = 10
MODEL_WARMUP = 3
LLAMA_ROWS = ("bf16-eager,bf16-compiled,torchao-tensorwise-compiled,fp8-current-eager,"
              "fp8-current-graphed,fp8-current-compiled-reduce-overhead")


def model_step_commands(out: Path) -> list[list[str]]:
    """The model_step.py argument lists run_all runs (printed by --dry-run)."""
    common = ["--steps", str(MODEL_STEPS), "--warmup", str(MODEL_WARMUP)]
    return [["--preset", "1b,small", *common, "--out", str(out / "model_step.json")],
            ["--preset", "llama-block", "--rows", LLAMA_ROWS, *common,
             "--out", str(out / "model_step_llama_block.json")]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only-model-step", action="store_true",
                        help="skip quantize_bandwidth and linear_step")
    parser.add_argument("--gpt-step", action="store_true", help="also run gpt_step.py")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the model_step.py commands and exit")
    args = parser.parse_args(argv)
    if args.dry_run:
        for command in model_step_commands(args.out):
            print("python benchmarks/model_step.py " + " ".join(command))
        return 0
    failures = 0
    if not args.only_model_step:
        failures += quantize_bandwidth.main(["--out", str(args.out)]) != 0
        failures += linear_step.main(["--out", str(args.out), "--torchao", "--rounds", "3",
                                      "--cuda-graph", "fp8-current,fp8-delayed"]) != 0
        failures += grouped_gemm_bench.main(["--out", str(args.out / "grouped_gemm.json")]) != 0
    for command in model_step_commands(args.out):
        failures += model_step.main(command) != 0
    if args.gpt_step:
        failures += gpt_step.main(["--out", str(args.out), "--single-thread-backward",
                                   "both"]) != 0
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
