"""MXFP8 master cast tile sweep (issue 16, nineteenth session): TILE_COLUMNS x NUM_WARPS of
the maxima-and-cast kernel, alternating rounds in one process, rank 0 of 8 at the 1b preset.

Run from the repository root:
    PYTHONPATH=src python benchmarks/results/mxfp8_master_tile_sweep_s19.py
(ROUNDS, PRESET, DEVICE, OUT from the environment). Result: mxfp8_master_tile_sweep_h200_s19.json.
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import master_cast as mc  # noqa: E402

from minifloat.kernels import master_cast_plan, master_cast_tiles  # noqa: E402

shapes = mc.weight_shapes(os.environ.get("PRESET", "1b"))
ranges = mc.rank_ranges(shapes, 8, 0)
device = os.environ.get("DEVICE", "cuda")
variants = [(256, 4), (128, 4), (128, 8), (256, 8)]
out = []
start = time.time()
for round_ in range(int(os.environ.get("ROUNDS", "2"))):
    for columns, warps in variants:
        master_cast_tiles.TILE_COLUMNS["mxfp8"] = columns
        master_cast_plan.NUM_WARPS = warps
        row = mc.measure_recipe("mxfp8", shapes, ranges, steps=3, device=device)
        line = {"round": round_, "columns": columns, "warps": warps,
                "kernel_ms": row["kernel_ms"], "required": row.get("required_copy_fraction"),
                "device_ms": row["device_ms"], "by_name": row["kernel_ms_by_name"]}
        out.append(line)
        print(json.dumps(line), f"{time.time() - start:.0f}s", flush=True)
Path(os.environ.get("OUT", "."), "mx_sweep.json").write_text(json.dumps(out, indent=1))
