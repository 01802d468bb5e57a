"""What saving a checkpoint costs: the lab GPT's weights in bf16 against the same model built
under quantized_model_init (weights stored quantized only), issue 20's target ("saving the 1b
preset's quantized weights costs no more than saving its bf16 weights").

For each row the model is built on the device, then its state dict (with each module's recipe
state) is saved REPEATS times with torch.save (one file) and with torch.distributed.checkpoint
(one process, a folder) under --dir; the median wall time of each (the device synchronized
first: the time includes the copy off the GPU) and the bytes written are reported.

    python benchmarks/checkpoint_save.py --preset 1b [--rows bf16,fp8-current,mxfp8,nvfp4]
        [--repeats 3] [--dir /tmp/minifloat_ckpt] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_step  # noqa: E402

import minifloat as mf  # noqa: E402
from minifloat.models.gpt import GPT, PRESETS  # noqa: E402

RECIPES = {"fp8-current": mf.Float8CurrentScaling, "fp8-delayed": mf.DelayedScaling,
           "fp8-block": mf.Float8BlockScaling, "mxfp8": mf.MXFP8BlockScaling,
           "nvfp4": mf.NVFP4BlockScaling}


def build(row: str, preset: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if row == "bf16":
        return GPT(PRESETS[preset], dtype=torch.bfloat16, device=device)
    with mf.quantized_model_init(recipe=RECIPES[row]()):
        return GPT(PRESETS[preset], dtype=torch.bfloat16, device=device)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _timed(save, path: Path, device: str, repeats: int) -> tuple[float, int]:
    times = []
    for _ in range(repeats):
        shutil.rmtree(path, ignore_errors=True)
        path.unlink(missing_ok=True)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        save(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times), _size(path)


def _dcp_save(dcp, state: dict, path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path))


def measure(row: str, preset: str, device: str, repeats: int, folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    model = build(row, preset, device)
    state = model.state_dict()
    weights = sum(v.numel() for v in model.parameters())
    torch_s, torch_bytes = _timed(partial(torch.save, state), folder / f"{row}.pt", device,
                                  repeats)
    dcp_s, dcp_bytes = _timed(partial(_dcp_save, dcp, state), folder / f"{row}.dcp", device,
                              repeats)
    shutil.rmtree(folder / f"{row}.dcp", ignore_errors=True)
    (folder / f"{row}.pt").unlink(missing_ok=True)
    del model, state
    model_step._free(device)
    return {"row": row, "preset": preset, "parameters": weights,
            "torch_save_s": round(torch_s, 4), "torch_save_bytes": torch_bytes,
            "dcp_save_s": round(dcp_s, 4), "dcp_save_bytes": dcp_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="bf16,fp8-current,mxfp8,nvfp4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/minifloat_checkpoint_bench"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    env = model_step.environment(args.device)
    rows = []
    for row in [name for name in args.rows.split(",") if name]:
        rows.append(measure(row, args.preset, args.device, args.repeats, args.dir))
        bf16 = next((r for r in rows if r["row"] == "bf16"), None)
        for key in ("torch_save_s", "dcp_save_s"):
            if bf16 is not None:
                rows[-1][key[:-2] + "_vs_bf16"] = round(rows[-1][key] / bf16[key], 3)
        print(json.dumps(rows[-1]), flush=True)
    out = args.out or model_step.RESULTS / (
        f"checkpoint_save_{model_step.device_slug(env)}_{args.preset}.json")
    out.write_text(json.dumps({"benchmark": "checkpoint_save", **env, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
