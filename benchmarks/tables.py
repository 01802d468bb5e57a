"""Markdown tables for BENCHMARKS.md from the JSON that run_all.py writes (no hand-typed numbers).

Usage: python benchmarks/tables.py DIR   (DIR holds quantize_bandwidth.json, linear_step.json,
gpt_step.json and model_step*.json; a missing file is skipped)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def quantize_table(data: dict) -> str:
    lines = [f"copy bandwidth in the same run: {data['copy_bandwidth_GBps']:.0f} GB/s "
             f"({data['device']}, torch {data['torch']})", "",
             "| format | ms | input reads | GB/s | x copy |", "|---|---:|---:|---:|---:|"]
    for name, row in data["formats"].items():
        lines.append(f"| {name} | {row['ms']:.3f} | {row['input_reads']} | "
                     f"{row['bandwidth_GBps']:.0f} | {row['fraction_of_copy']:.3f} |")
    return "\n".join(lines)


def linear_table(data: dict) -> str:
    recipes: list[str] = []
    shapes: dict[tuple, dict[str, float]] = {}
    for row in data["rows"]:
        shape = tuple(row["shape"])
        shapes.setdefault(shape, {})[row["recipe"]] = row["ms"]
        if row["recipe"] not in recipes:
            recipes.append(row["recipe"])
    lines = [f"{data['device']}, torch {data['torch']}; ms per step (speed-up against bf16)", "",
             "| M x K x N | " + " | ".join(recipes) + " |",
             "|---|" + "---:|" * len(recipes)]
    for shape, times in shapes.items():
        base = times.get("bf16")
        cells = []
        for recipe in recipes:
            ms = times.get(recipe)
            if ms is None:
                cells.append("")
            elif recipe == "bf16" or base is None:
                cells.append(f"{ms:.3f}")
            else:
                cells.append(f"{ms:.3f} ({base / ms:.2f}x)")
        lines.append(f"| {' x '.join(map(str, shape))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpt_table(data: dict) -> str:
    lines = [f"{data['device']}, torch {data['torch']}", "",
             "| preset | step | recipe | ms/step | tokens/s | vs bf16 | final loss | peak GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in data["rows"]:
        mode = "CUDA graph" if row.get("cuda_graph") else (
            "eager, single-thread backward" if row.get("single_thread_backward") else "eager")
        if "error" in row:
            lines.append(f"| {row['preset']} | {mode} | {row['recipe']} | failed: "
                         f"{row['error']} | | | | |")
            continue
        ratio = "" if row["vs_bf16"] is None else f"{row['vs_bf16']:.2f}x"
        lines.append(f"| {row['preset']} | {mode} | {row['recipe']} | {row['step_ms']:.1f} | "
                     f"{row['tokens_per_s']:.0f} | {ratio} | {row['final_loss']:.3f} | "
                     f"{row['peak_memory_gib']:.1f} |")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def model_step_line(row: dict) -> str:
    """One row of model_step.py / gpt_step.py as a progress line (printed as rows finish)."""
    head = f"{row.get('preset', ''):>11s} {row['row']:>36s}"
    if "skipped" in row or "error" in row:
        what = "skipped" if "skipped" in row else "failed"
        return f"{head} {what}: {row.get('skipped') or row.get('error')}"
    host16 = _fmt(row.get("host16_ms"), ".2f", " ms")
    if "host16_error" in row:
        host16 = f"failed: {row['host16_error'][:80]}"
    return (f"{head} {row['ms_per_step']:9.2f} ms/step  host {row['host_ms']:8.2f} ms  "
            f"kernels {_fmt(row.get('kernels_per_step'), 'd') or '-':>5s}  "
            f"peak {_fmt(row.get('peak_gib'), '.1f', ' GiB') or '-'}  "
            f"loss {row['first_loss']:.3f} -> {row['final_loss']:.3f}  "
            f"first step {row['first_step_s']:.1f} s  16-token host {host16 or '-'}")


def model_step_table(data: dict) -> str:
    """model_step.py's JSON (gpt_step.py's too) as a markdown table with both baselines."""
    extra = [key for key in ("speedup_vs_bf16_graph",)
             if any(row.get(key) is not None for row in data["rows"])]
    lines = [f"{data['device']}, torch {data['versions']['torch']}, torchao "
             f"{data['versions'].get('torchao')}; {data['steps']} timed steps after "
             f"{data['warmup']} warm-up; speed-up = baseline ms / row ms (>1 faster); 16-token "
             "cost = row / bf16-eager host time (fwd+bwd; step: whole training steps)", "",
             "| preset | row | ms/step | vs bf16 eager | vs bf16 compiled | "
             + "".join("vs bf16 graph | " for _ in extra)
             + "tokens/s | host ms | kernels | peak GiB | loss first/last | "
             "16-token fwd+bwd host ms | 16-token cost | 16-token step cost |",
             "|---|---|---:|---:|---:|" + "---:|" * len(extra)
             + "---:|---:|---:|---:|---|---:|---:|---:|"]
    for row in data["rows"]:
        if "skipped" in row or "error" in row:
            what = "skipped" if "skipped" in row else "failed"
            message = (row.get("skipped") or row.get("error")).replace("|", "/")
            lines.append(f"| {row.get('preset', '')} | {row['row']} | {what}: {message} |")
            continue
        config = data.get("configs", {}).get(row.get("preset"), {})
        tokens = config.get("batch_size", 0) * config.get("seq_len", 0)
        ratios = [row.get("speedup_vs_bf16_eager"), row.get("speedup_vs_bf16_compiled")] + [
            row.get(key) for key in extra]
        host16 = _fmt(row.get("host16_ms"), ".2f")
        if "host16_error" in row:
            host16 = "failed"
        cells = [row.get("preset", ""), row["row"], f"{row['ms_per_step']:.2f}",
                 *(_fmt(r, ".2f", "x") for r in ratios),
                 _fmt(tokens / row["ms_per_step"] * 1e3 if tokens else None, ".0f"),
                 f"{row['host_ms']:.2f}", _fmt(row.get("kernels_per_step"), "d"),
                 _fmt(row.get("peak_gib"), ".1f"),
                 f"{row['first_loss']:.3f} / {row['final_loss']:.3f}", host16,
                 _fmt(row.get("host16_cost_vs_bf16"), ".2f", "x"),
                 _fmt(row.get("host16_step_cost_vs_bf16"), ".2f", "x")]
        lines.append("| " + " | ".join(cells) + " |")
    for note in data.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(args[0])
    for name, render in (("quantize_bandwidth.json", quantize_table),
                         ("linear_step.json", linear_table), ("gpt_step.json", gpt_table)):
        path = folder / name
        if path.exists():
            data = json.loads(path.read_text())
            if name == "gpt_step.json" and data.get("benchmark") == "gpt_step":
                render = model_step_table  # the reworked gpt_step.py writes model_step rows
            print(f"### {name}\n\n{render(data)}\n")
    for path in sorted(folder.glob("model_step*.json")):
        print(f"### {path.name}\n\n{model_step_table(json.loads(path.read_text()))}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
