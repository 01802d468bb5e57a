"""What a comparison leaves behind: the table, results.json, two CSVs and the loss-curve PNG.

Files written into the --out folder:

    table.txt        the table the command prints
    results.json     the configuration, and per recipe its summary and full curves
    results.csv      one row per recipe: the table's numbers, unformatted
    curves.csv       one row per recipe per step: train_loss, and val_loss on evaluated steps
                     (empty elsewhere) - the long format that pandas and spreadsheets pivot
    loss_curves.png  training loss (left) and the validation gap to bf16 (right)

The summary and the curves are separate CSVs because they have different shapes; a single CSV
would repeat the summary on every step's row. NaN (a diverged run) is null in JSON and empty in
CSV. The PNG needs matplotlib (the `lab` extra); without it the PNG is skipped with a warning
naming the fix, and everything else is still written.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from .compare import COST_STEPS, Comparison, RunResult
from .health import loss_flags, moving_average
from .noise_control import CONTROL
from .recipe_specs import BASELINE

MATPLOTLIB_FIX = "pip install 'minifloat[lab]' (or pip install matplotlib==3.11.2)"


def baseline_run(comparison: Comparison) -> RunResult | None:
    return next((run for run in comparison.runs if run.label == BASELINE), None)


def gap_percent(run: RunResult, baseline: RunResult | None) -> float:
    """Final validation loss relative to bf16's, in percent (positive = worse than bf16)."""
    if baseline is None or not math.isfinite(baseline.final_val_loss):
        return math.nan
    return (run.final_val_loss / baseline.final_val_loss - 1.0) * 100.0


def _number(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "nan"


def _gap_cell(run: RunResult, baseline: RunResult | None) -> str:
    if run.diverged_at is not None:
        return f"diverged@{run.diverged_at}"
    if baseline is None:
        return "—"
    if run is baseline:
        return "baseline"
    gap = gap_percent(run, baseline)
    return f"{gap:+.2f}%" if math.isfinite(gap) else "—"


def format_table(comparison: Comparison) -> str:
    """The aligned plain-text table, with a header line saying what was run where."""
    plan = comparison.plan
    baseline = baseline_run(comparison)
    header = ("recipe", "train loss", "val loss", "gap to bf16", "tokens/s", "peak MiB",
              "high precision")
    kept = plan.describe()["high_precision"]
    rows = [(run.label, _number(run.final_train_loss, 3), _number(run.final_val_loss, 3),
             _gap_cell(run, baseline), _number(run.tokens_per_second, 0),
             _number(run.peak_memory_mib, 0), "+".join(kept.get(run.label, [])) or "-")
            for run in comparison.runs]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest)).rstrip()

    description = plan.describe()
    emulated = ("quantized GEMMs emulated" if plan.device.type == "cpu"
                else "GPU fast paths where available")
    title = (f"{plan.preset} preset ({plan.model.parameter_count() / 1e6:.1f}M parameters), "
             f"{plan.steps} steps x {plan.model.tokens_per_step} tokens, seed {plan.seed}, "
             f"lr {plan.lr:g}, {description['device']}, {description['params_dtype']} "
             f"parameters, {emulated}")
    memory = comparison.runs[0].memory_kind if comparison.runs else ""
    notes = ["train loss: mean over the last 10% of steps; val loss: "
             f"{plan.val_batches} fixed validation batches after the last step",
             "gap to bf16: val loss relative to the bf16 run (+ = worse); "
             f"peak MiB: {memory}"]
    if any(run.label == CONTROL for run in comparison.runs):
        notes.append(f"{CONTROL}: bf16 with its initial weights nudged by one bf16 step; its "
                     "gap is what chaos alone does to this seed, so read the others against it")
    if comparison.deterministic_cost is not None:
        notes.append(f"deterministic algorithms on: the bf16 step took "
                     f"{comparison.deterministic_cost:.2f}x its time without them "
                     f"({COST_STEPS} steps measured before the comparison)")
    rule = "-" * len(line(header))
    flags = [f"warning: {flag}" for run in comparison.runs
             for flag in loss_flags(run.label, run.train_loss)]
    return "\n".join([title, "", line(header), rule, *map(line, rows), "", *notes,
                      *([""] + flags if flags else [])])


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _summary(run: RunResult, baseline: RunResult | None) -> dict[str, Any]:
    return {
        "final_train_loss": _finite(run.final_train_loss),
        "final_val_loss": _finite(run.final_val_loss),
        "gap_to_bf16_percent": _finite(gap_percent(run, baseline)),
        "tokens_per_second": _finite(run.tokens_per_second),
        "peak_memory_mib": _finite(run.peak_memory_mib),
        "memory_kind": run.memory_kind,
        "seconds": run.seconds,
        "diverged_at": run.diverged_at,
        "flags": loss_flags(run.label, run.train_loss),
    }


def results_dict(comparison: Comparison) -> dict[str, Any]:
    """The content of results.json."""
    baseline = baseline_run(comparison)
    config = comparison.plan.describe()
    return {
        "config": config,
        "deterministic_cost": comparison.deterministic_cost,
        "baseline": baseline.label if baseline else None,
        "runs": [{
            "label": run.label,
            "recipe": config["recipes"].get(run.label, ""),
            "high_precision": config["high_precision"].get(run.label, []),
            "summary": _summary(run, baseline),
            "train_loss": [_finite(v) for v in run.train_loss],
            "val_loss": [[step, _finite(v)] for step, v in run.val_loss],
        } for run in comparison.runs],
    }


def _csv_value(value: object) -> object:
    return "" if value is None or (isinstance(value, float) and not math.isfinite(value)) \
        else value


def _write_csvs(comparison: Comparison, out: Path) -> list[Path]:
    baseline = baseline_run(comparison)
    summary_path, curves_path = out / "results.csv", out / "curves.csv"
    fields = ["recipe", "final_train_loss", "final_val_loss", "gap_to_bf16_percent",
              "tokens_per_second", "peak_memory_mib", "memory_kind", "seconds", "diverged_at"]
    with summary_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for run in comparison.runs:
            summary = _summary(run, baseline)
            writer.writerow([run.label, *(_csv_value(summary[f]) for f in fields[1:])])
    with curves_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["recipe", "step", "train_loss", "val_loss"])
        for run in comparison.runs:
            val = dict(run.val_loss)
            for step, loss in enumerate(run.train_loss, start=1):
                writer.writerow([run.label, step, _csv_value(loss), _csv_value(val.get(step))])
    return [summary_path, curves_path]


def plot_curves(comparison: Comparison, path: Path) -> None:
    """Training loss per step (left) and validation loss relative to bf16 (right)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    baseline = baseline_run(comparison)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    window = max(1, comparison.plan.steps // 20)
    for run in comparison.runs:
        steps = range(1, len(run.train_loss) + 1)
        # bf16 dashed and on top, so the quantized curves cannot hide it
        style = ({"color": "black", "linewidth": 1.6, "linestyle": "--", "zorder": 3}
                 if run is baseline else {"linewidth": 1.4})
        (drawn,) = left.plot(steps, moving_average(run.train_loss, window), label=run.label,
                             **style)
        colour = drawn.get_color()
        if baseline is not None:
            base = dict(baseline.val_loss)
            points = [(s, (v / base[s] - 1) * 100) for s, v in run.val_loss if s in base]
        else:
            points = list(run.val_loss)
        if points:
            right.plot(*zip(*points, strict=True), marker="o", color=colour, label=run.label,
                       linewidth=1.4)
    left.set(xlabel="step", ylabel=f"training loss (moving average of {window})",
             title="training loss")
    if baseline is not None:
        right.axhline(0.0, color="grey", linewidth=0.8)
        right.set(ylabel="val loss vs bf16 (%), + = worse", title="validation gap to bf16")
    else:
        right.set(ylabel="validation loss", title="validation loss")
    right.set_xlabel("step")
    for axes in (left, right):
        axes.grid(alpha=0.3)
    left.legend(fontsize=8)
    plan = comparison.plan
    figure.suptitle(f"minifloat recipe comparison: {plan.preset} preset, {plan.steps} steps, "
                    f"seed {plan.seed}, {plan.device.type}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_reports(comparison: Comparison, plot: bool = True) -> list[Path]:
    """Write every file into plan.out_dir; returns their paths (also kept on comparison)."""
    out = comparison.plan.out_dir
    out.mkdir(parents=True, exist_ok=True)
    table_path, json_path = out / "table.txt", out / "results.json"
    table_path.write_text(format_table(comparison) + "\n")
    json_path.write_text(json.dumps(results_dict(comparison), indent=1, allow_nan=False) + "\n")
    written = [table_path, json_path, *_write_csvs(comparison, out)]
    if plot:
        png = out / "loss_curves.png"
        try:
            plot_curves(comparison, png)
            written.append(png)
        except ImportError:
            warning = f"warning: loss_curves.png skipped: matplotlib is not installed; " \
                      f"{MATPLOTLIB_FIX}"
            if warning not in comparison.warnings:
                comparison.warnings.append(warning)
    comparison.written = written
    return written
