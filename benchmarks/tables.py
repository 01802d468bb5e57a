"""Markdown tables for BENCHMARKS.md from the JSON that run_all.py writes (no hand-typed numbers).

Usage: python benchmarks/tables.py DIR   (DIR holds quantize_bandwidth.json, linear_step.json,
gpt_step.json; a missing file is skipped)
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
            print(f"### {name}\n\n{render(json.loads(path.read_text()))}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
