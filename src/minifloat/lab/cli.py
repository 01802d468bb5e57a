"""`python -m minifloat COMMAND`: the project's command line.

    compare   train the same model under several recipes and compare loss, speed and memory
    demo      `compare` with the default demo recipes, writing to demo-out/
    formats   quantize one tensor in every format and print bytes and error
    advise    measure each GEMM operand's quantization error under a recipe and propose which
              to keep in high precision within a FLOP budget (a spec compare accepts)

Every mistake in the arguments is reported as `error: ...` on stderr with exit status 2 (the
argparse convention) before any training starts; main() returns the status instead of raising
SystemExit, so tests and other Python callers can call it directly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEMO_STEPS = 200


def _steps(text: str) -> int:
    """argparse type for --steps: a clear message instead of argparse's 'invalid int value'."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps >= 1, got {text!r}") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_compare_arguments(parser: argparse.ArgumentParser, default_steps: int,
                           default_out: str) -> None:
    from ..models.gpt import PRESETS
    from .compare import DEFAULT_VAL_BATCHES, DEMO_RECIPES, PRESET_LR

    parser.add_argument("--recipes", default=DEMO_RECIPES,
                        help=f"comma-separated recipe specs (default {DEMO_RECIPES}); "
                             "'--recipes help' lists names and syntax")
    parser.add_argument("--steps", type=_steps, default=default_steps,
                        help=f"training steps per recipe (default {default_steps})")
    parser.add_argument("--preset", default="tiny",
                        help=f"model preset: {', '.join(PRESETS)} (default tiny)")
    parser.add_argument("--out", default=default_out,
                        help=f"folder for table.txt, results.json/csv, curves.csv and "
                             f"loss_curves.png (default {default_out})")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and batches")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch's deterministic algorithms where they exist; the report "
                             "says what they cost in speed (measured on the bf16 model)")
    parser.add_argument("--seeds", default=None,
                        help="comma list of seeds, e.g. 0,1,2: a comparison per seed (in "
                             "OUT/seed{N}), then each recipe's mean and spread, and gaps within "
                             "the bf16 runs' spread marked as noise (seeds.txt, seeds.json)")
    parser.add_argument("--data", default=None,
                        help="a text file or folder to train on (default: the Python "
                             "standard library's sources)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: the preset's, from the recorded "
                             "bf16 sweeps: " + ", ".join(f"{name} {lr:g}"
                                                         for name, lr in PRESET_LR.items())
                             + ")")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="validate every N steps and after the last (default: 4 times, "
                             "evenly spaced; 0: only after the last step)")
    parser.add_argument("--val-batches", type=int, default=DEFAULT_VAL_BATCHES,
                        help=f"validation batches per evaluation (default "
                             f"{DEFAULT_VAL_BATCHES})")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda when available (fast paths), else cpu (emulation)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minifloat",
                                     description="minifloat: FP8, MXFP8 and NVFP4 training.")
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser(
        "compare", help="train one model per recipe; compare loss, tokens/s and memory",
        description="Train the same model from the same seed under each recipe; print a table "
                    "and write results.json, results.csv, curves.csv and loss_curves.png.")
    _add_compare_arguments(compare, default_steps=200, default_out="compare-out")
    demo = commands.add_parser(
        "demo", help="compare with the demo recipes (what scripts/demo runs)",
        description="The default comparison: bf16 against FP8, MXFP8, NVFP4 and an "
                    "MXFP8-forward/NVFP4-backward hybrid on the tiny preset.")
    _add_compare_arguments(demo, default_steps=DEMO_STEPS, default_out="demo-out")
    formats = commands.add_parser("formats",
                                  help="quantize a tensor in every format and compare")
    formats.add_argument("--rows", type=int, default=1024)
    formats.add_argument("--cols", type=int, default=1024)
    advise = commands.add_parser(
        "advise", help="rank GEMM operands by quantization error; propose a recipe spec",
        description="Record every GEMM operand of the preset's model on a few batches in high "
                    "precision, score each operand under the recipe (SQNR of the GEMM outputs "
                    "it feeds), and propose the operands to keep in high precision within "
                    "--budget of the GEMM FLOPs, as a spec `compare --recipes` takes.")
    advise.add_argument("--preset", default="tiny")
    advise.add_argument("--recipe", required=True, help="a recipe spec, e.g. nvfp4")
    advise.add_argument("--budget", type=float, default=0.1,
                        help="share of GEMM FLOPs that may run in high precision (default 0.1)")
    advise.add_argument("--batches", type=int, default=2, help="batches to record (default 2)")
    advise.add_argument("--seed", type=int, default=0)
    advise.add_argument("--data", default=None, help="text file or folder (default: stdlib)")
    advise.add_argument("--checkpoint", default=None,
                        help="a state dict of the lab GPT (or a compare checkpoint) to measure "
                             "instead of the freshly initialised model")
    advise.add_argument("--rows", type=int, default=20, help="table rows (worst first)")
    advise.add_argument("--sr-draws", type=int, default=None,
                        help="stochastically rounded copies are scored as the mean of this "
                             "many draws (their noise averages out over steps; default "
                             "advisor.SR_DRAWS, 8; 1: one draw)")
    advise.add_argument("--finer", default=None, metavar="NAME",
                        help="a named recipe one GEMM may use instead (e.g. --recipe nvfp4 "
                             "--finer mxfp8): the three hybrids that move fprop, dgrad or "
                             "wgrad to it are measured end to end and the best is proposed")
    advise.add_argument("--check", action="store_true",
                        help="also measure the given recipe and the proposed spec end to end "
                             "(whole-model gradient SQNR and loss against high precision)")
    advise.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model runs and the operands are scored (default cpu)")
    return parser


def _advise(args: argparse.Namespace) -> int:
    from .advisor import SR_DRAWS, advise, format_advice

    if args.batches < 1:
        print("error: --batches must be >= 1", file=sys.stderr)
        return 2
    try:
        advice = advise(args.preset, args.recipe, args.budget, args.batches, args.seed,
                        args.data, args.checkpoint, device=args.device,
                        sr_draws=SR_DRAWS if args.sr_draws is None else args.sr_draws,
                        finer=args.finer, check=args.check)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_advice(advice, args.rows))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .compare import ComparisonError, prepare_comparison, request_deterministic_cublas
    from .recipe_specs import recipes_help

    if args.deterministic:
        request_deterministic_cublas()
    if args.recipes.strip().lower() == "help":
        print(recipes_help())
        return 0
    try:
        seeds = _seeds(args.seeds) if args.seeds is not None else None
        plans = [prepare_comparison(args.recipes, args.steps, args.preset,
                                    Path(args.out) / f"seed{seed}" if seeds else args.out,
                                    seed, args.data, args.device, args.lr, args.eval_every,
                                    args.val_batches, args.deterministic)
                 for seed in (seeds or [args.seed])]
    except ComparisonError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    comparisons = [_run_one(plan, args) for plan in plans]
    if seeds:
        from .seeds import format_summary, summarise, write_summary

        written = write_summary(comparisons, Path(args.out))
        print("\n" + format_summary(summarise(comparisons)))
        print("\nwrote " + ", ".join(str(path) for path in written))
    return 0


def _seeds(text: str) -> list[int]:
    from .compare import ComparisonError

    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ComparisonError(f"--seeds takes a comma list of integers, got {text!r}") from None
    if len(seeds) < 2 or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ComparisonError(f"--seeds needs at least two distinct seeds >= 0, got {text!r}")
    return seeds


def _run_one(plan: Any, args: argparse.Namespace) -> Any:
    """Train one plan (one seed), print its table; the Comparison."""
    from .compare import run_plan
    from .report import format_table

    labels = ", ".join(label for label, _ in plan.recipes)
    print(f"comparing {labels}: {plan.steps} steps each on {plan.device.type}, "
          f"writing to {plan.out_dir}", file=sys.stderr, flush=True)
    comparison = run_plan(plan, progress=not args.no_progress)
    print(format_table(comparison))
    for warning in comparison.warnings:
        print(warning, file=sys.stderr)
    print("\nwrote " + ", ".join(str(path) for path in comparison.written))
    return comparison


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command in ("compare", "demo"):
        return _compare(args)
    if args.command == "advise":
        return _advise(args)
    from .showcase import print_showcase

    print_showcase(args.rows, args.cols)
    return 0
