"""Several seeds per recipe (issue 19): each recipe's mean and spread, and gaps marked as within
noise when the bf16 runs themselves spread more.

Why: one bf16 run per seed is not one number. Three bf16 runs of the `small` preset with one
seed gave 2.286, 2.304 and 2.309 (issue 19), a 1% spread as large as most recipe gaps. With
`--seeds 0,1,2` every seed is a full comparison of its own (its folder seed{N} holds that
seed's table, JSON, CSVs and plot), and this module summarises them: per recipe the mean, the
sample standard deviation and the min..max of the final validation loss over the seeds, the
gap of the means to bf16's mean, and "within noise" when that gap is smaller than bf16's
spread (max - min, relative to its mean). seeds.txt and seeds.json hold the summary, and
seeds.png the training curves as min..max bands across seeds (with matplotlib).

Paired gaps: a recipe and bf16 of the same seed start from the same weights and read the same
batches, so each seed's gap to its own bf16 run carries none of the seed-to-seed spread. On an
H100 (small preset, 2000 steps, seeds 0-2) bf16's final losses spread 7% over the seeds, so the
unpaired rule called NVFP4's +6.3% "within noise", while NVFP4 was worse than the same-seed
bf16 run in every seed (+4.9% to +7.7%). A gap is therefore within noise only when it is
inside bf16's spread and the recipe is not worse (or better) than bf16 in every seed.

The paired gaps have a noise floor of their own: chaos moves even a recipe that costs nothing
away from its bf16 twin. With the `bf16-nudged` control among the recipes (lab.noise_control:
bf16 with its initial weights moved by one bf16 step), the largest of its same-seed gaps over
the seeds is that floor, and a recipe whose mean paired gap is no larger is marked "within the
control's".
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from pathlib import Path
from typing import Any

from .compare import Comparison
from .health import moving_average
from .noise_control import CONTROL
from .recipe_specs import BASELINE


def summarise(comparisons: list[Comparison]) -> dict[str, Any]:
    """{recipe label: mean, std, min, max, seeds, gap_percent, within_noise} over the seeds."""
    labels = [run.label for run in comparisons[0].runs]
    finals = {label: [next(run.final_val_loss for run in c.runs if run.label == label)
                      for c in comparisons] for label in labels}
    seeds = [c.plan.seed for c in comparisons]
    baseline = finals.get(BASELINE)
    base_mean = statistics.fmean(baseline) if baseline else math.nan
    noise = ((max(baseline) - min(baseline)) / base_mean * 100.0
             if baseline and base_mean > 0 and all(map(math.isfinite, baseline)) else math.nan)
    summary: dict[str, Any] = {"seeds": seeds, "bf16_spread_percent": _finite(noise),
                               "recipes": {}}
    for label, values in finals.items():
        finite = [v for v in values if math.isfinite(v)]
        mean = statistics.fmean(finite) if len(finite) == len(values) else math.nan
        gap = (mean / base_mean - 1.0) * 100.0 if baseline and label != BASELINE else math.nan
        # paired: each seed's gap to the bf16 run of the same seed (same initial weights and
        # batches), which removes the seed-to-seed spread the unpaired gap carries
        paired = ([(v / b - 1.0) * 100.0 for v, b in zip(values, baseline, strict=True)]
                  if baseline and label != BASELINE else [])
        paired_ok = bool(paired) and all(map(math.isfinite, paired))
        consistent = _consistent_sign(paired) if paired_ok and len(paired) > 1 else None
        summary["recipes"][label] = {
            "paired_gaps_percent": [_finite(g) for g in paired],
            "paired_gap_mean": _finite(statistics.fmean(paired)) if paired_ok else None,
            "paired_verdict": consistent,
            "val_losses": [_finite(v) for v in values],
            "mean": _finite(mean),
            "std": _finite(statistics.stdev(finite)) if len(finite) > 1 else None,
            "min": _finite(min(values)), "max": _finite(max(values)),
            "gap_percent": _finite(gap),
            # within the bf16 runs' spread, and not worse (or better) in every seed
            "within_noise": ((abs(gap) < noise and consistent in (None, "mixed"))
                             if math.isfinite(gap) and math.isfinite(noise) else None),
        }
    _mark_within_control(summary)
    return summary


def _mark_within_control(summary: dict[str, Any]) -> None:
    """The control's largest same-seed gap as the floor; each recipe's mean paired gap
    against it (None everywhere when the control did not run or a gap is not finite)."""
    control = summary["recipes"].get(CONTROL)
    gaps = control["paired_gaps_percent"] if control else []
    floor = (max(abs(g) for g in gaps) if gaps and all(g is not None for g in gaps)
             else None)
    summary["paired_noise_floor_percent"] = floor
    for label, row in summary["recipes"].items():
        mean = row["paired_gap_mean"]
        row["within_control"] = (abs(mean) <= floor if floor is not None and mean is not None
                                 and label not in (BASELINE, CONTROL) else None)


def _consistent_sign(paired: list[float]) -> str:
    if all(g > 0 for g in paired):
        return "worse in every seed"
    if all(g < 0 for g in paired):
        return "better in every seed"
    return "mixed"


def format_summary(summary: dict[str, Any]) -> str:
    noise = summary["bf16_spread_percent"]
    header = ("recipe", "val loss mean", "std", "min..max", "gap to bf16", "",
              "per-seed gaps (same-seed bf16)")
    rows = []
    for label, row in summary["recipes"].items():
        gap = row["gap_percent"]
        paired = row.get("paired_gaps_percent") or []
        rows.append((label, _cell(row["mean"], 4), _cell(row["std"], 4),
                     f"{_cell(row['min'], 3)}..{_cell(row['max'], 3)}",
                     "baseline" if label == BASELINE else (f"{gap:+.2f}%" if gap is not None
                                                           else "—"),
                     ", ".join(flag for flag, on in (("within noise", row["within_noise"]),
                                                     ("within the control's",
                                                      row.get("within_control"))) if on),
                     " ".join("nan" if g is None else f"{g:+.2f}%" for g in paired)
                     + (f" ({row['paired_verdict']})" if row.get("paired_verdict") else "")))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [f"{len(summary['seeds'])} seeds {summary['seeds']}; bf16 spread (max - min over "
             f"its mean): {_cell(noise, 2)}%; a gap smaller than that is within noise unless "
             "the recipe is worse (or better) than bf16 in every seed"]
    floor = summary.get("paired_noise_floor_percent")
    if floor is not None:
        lines.append(f"{CONTROL} (bf16, initial weights nudged by one bf16 step) ended within "
                     f"{floor:.2f}% of the same-seed bf16 run: a mean same-seed gap no larger "
                     "is within the control's noise")
    lines += ["",
             "  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip() for row in rows]
    return "\n".join(lines)


def write_summary(comparisons: list[Comparison], out_dir: Path) -> list[Path]:
    summary = summarise(comparisons)
    out_dir.mkdir(parents=True, exist_ok=True)
    text, data = out_dir / "seeds.txt", out_dir / "seeds.json"
    text.write_text(format_summary(summary) + "\n")
    data.write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    written = [text, data]
    with contextlib.suppress(ImportError):  # the per-seed folders say how to install it
        written.append(_plot_bands(comparisons, summary, out_dir / "seeds.png"))
    return written


def _plot_bands(comparisons: list[Comparison], summary: dict[str, Any], path: Path) -> Path:
    """Left: each recipe's training loss (moving average, as the single-seed plot) as the mean
    over the seeds with a min..max band. Right: each recipe's final validation loss against the
    bf16 run of the same seed, per seed and their mean, beside the bf16-nudged control's noise
    floor when it ran: the comparison the verdicts make, drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5),
                                         gridspec_kw={"width_ratios": [3, 2]})
    steps_run = comparisons[0].plan.steps
    window = max(1, steps_run // 20)
    start = max(0, steps_run // 10)  # the first tenth (warm-up, the steep fall) scales nothing
    colors = {}
    for run in comparisons[0].runs:
        curves = [moving_average(next(r.train_loss for r in c.runs if r.label == run.label),
                                 window) for c in comparisons]
        steps = min(len(curve) for curve in curves)
        x = range(start + 1, steps + 1)
        low = [min(curve[s] for curve in curves) for s in range(start, steps)]
        high = [max(curve[s] for curve in curves) for s in range(start, steps)]
        mean = [statistics.fmean(curve[s] for curve in curves) for s in range(start, steps)]
        (line,) = left.plot(x, mean, label=_short(run.label), linewidth=1.2)
        colors[run.label] = line.get_color()
        left.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    left.set(xlabel="step", ylabel=f"training loss, moving average of {window}",
             title="mean and min..max over the seeds")
    left.legend()
    if BASELINE in summary["recipes"]:
        _plot_paired_gaps(right, summary, colors)
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def _plot_paired_gaps(axis: Any, summary: dict[str, Any], colors: dict[str, str]) -> None:
    """Each recipe's same-seed gaps (dots, one per seed) and their mean (a bar), and the band
    of +-the control's largest gap: what chance alone does to a same-seed gap."""
    floor = summary.get("paired_noise_floor_percent")
    if floor is not None:
        axis.axhspan(-floor, floor, color="grey", alpha=0.2,
                     label=f"{CONTROL}: chance alone (\u00b1{floor:.2f}%)")
    labels = [label for label in summary["recipes"] if label != BASELINE]
    for position, label in enumerate(labels):
        gaps = [gap for gap in summary["recipes"][label]["paired_gaps_percent"]
                if gap is not None]
        if not gaps:
            continue
        axis.scatter([position] * len(gaps), gaps, s=16, color=colors.get(label))
        axis.hlines(statistics.fmean(gaps), position - 0.3, position + 0.3,
                    color=colors.get(label), linewidth=2)
    axis.set_xticks(range(len(labels)), [_short(label) for label in labels], rotation=30,
                    ha="right")
    axis.axhline(0.0, color="black", linewidth=0.6)
    axis.margins(y=0.2)  # room for the legend beside the dots
    axis.set(ylabel="final val loss vs the same-seed bf16 run (%)",
             title="per seed (dots) and mean (bar)")
    if floor is not None:
        axis.legend(loc="best")


def _short(label: str, width: int = 34) -> str:
    """A recipe label short enough for a legend: an advisor spec's operand list becomes its
    count (nvfp4@hp=a:x+b:y -> nvfp4@hp(2 operands)), anything else longer is cut."""
    if "@hp=" in label:
        head, _, rest = label.partition("@hp=")
        operands = rest.split("@")[0].split("+")
        label = f"{head}@hp({len(operands)} operand{'s' if len(operands) > 1 else ''})"
    return label if len(label) <= width else label[:width - 3] + "..."


def _finite(value: float) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _cell(value: float | None, digits: int) -> str:
    return "nan" if value is None else f"{value:.{digits}f}"
