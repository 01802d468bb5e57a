"""Sweep tile shapes, warps and code paths of the quantize kernels in one run (see KERNEL_NOTES.md).

Each variant overrides module-level launch constants of a kernel module (tile sizes, warps,
unroll) or an environment switch, runs the kernel entry on a 16384x8192 bf16 input, checks that
its output bytes equal the first variant of its group (bit-exactness must not depend on the
config), and times it with triton's do_bench (median). Prints one table: ms, GB/s over the
format's floor bytes, fraction of the device-to-device copy bandwidth measured in the same run.

Usage: python benchmarks/tune_kernels.py [--only amax,pt,mx,blk,nv,nv/2d,...] [--out DIR]
       [--budget S]   (--only takes sections or single groups)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))


@contextlib.contextmanager
def _override(module, values: dict):
    saved = {}
    env_saved = {}
    for key, value in values.items():
        if key.startswith("ENV:"):
            name = key[4:]
            env_saved[name] = os.environ.get(name)
            os.environ[name] = value
        else:
            saved[key] = getattr(module, key)
            setattr(module, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(module, key, value)
        for name, value in env_saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, dict):
        out = [out[k] for k in sorted(out)]
    tensors = []
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if t is None:
            continue
        if isinstance(t, (list, tuple, dict)):
            tensors += _flatten(t)
        else:
            tensors.append(t.contiguous().reshape(-1).view(torch.uint8))
    return tensors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="amax,pt,mx,blk,nv")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds; later variants skip")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_kernels: no CUDA device", file=sys.stderr)
        return 0
    from minifloat.kernels import amax, block_fp8, mxfp8, nvfp4, per_tensor_fp8

    start = time.time()
    sections = set(args.only.split(","))
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    # rows of very different magnitudes, so block scales vary (and some elements go subnormal)
    x *= torch.exp2(torch.randint(-20, 20, (args.rows, 1), device="cuda").float()).bfloat16()
    n = x.numel()
    target = torch.empty_like(x)
    copy_ms = _bench(lambda: target.copy_(x))
    copy_bw = 2 * n * 2 / (copy_ms * 1e-3)
    rows = []
    e4m3 = torch.float8_e4m3fn
    scale = torch.full((1,), 0.5, device="cuda")
    amax_state = torch.zeros(1, device="cuda")

    def group(title, module, floor_bytes, fn, variants, seeded=False):
        if title not in sections and title.split("/")[0] not in sections:  # "nv" or "nv/2d"
            return
        reference = None
        for label, values in variants:
            if time.time() - start > args.budget:
                rows.append((title, label, float("nan"), "skipped (budget)"))
                continue
            try:
                with _override(module, values):
                    if seeded:
                        torch.manual_seed(1)
                    out = _flatten(fn())
                    torch.cuda.synchronize()
                    if reference is None:
                        reference = out
                        same = "ref"
                    else:
                        equal = all(torch.equal(a, b)
                                    for a, b in zip(out, reference, strict=True))
                        same = "same" if equal else "DIFFERS"
                    del out
                    ms = _bench(fn)
                rows.append((title, label, ms, same, floor_bytes / (ms * 1e-3)))
            except Exception as error:  # noqa: BLE001 - report and go on with the sweep
                rows.append((title, label, float("nan"), f"ERROR {type(error).__name__}: "
                             f"{str(error).splitlines()[0][:80] if str(error) else ''}"))
            print(rows[-1], flush=True)

    # ---- amax: read-only floor n*2 bytes
    group("amax", amax, n * 2, lambda: amax.compute_amax(x), [
        ("b4096 u1 w8 p4 fp32-bits (v0)", {"AMAX_BF16_BITS": False}),
        ("b4096 u1 w8 p4 bf16-bits", {"AMAX_BF16_BITS": True}),
        ("b4096 u4 w8 p4 fp32-bits", {"AMAX_UNROLL": 4, "AMAX_BF16_BITS": False}),
        ("b4096 u4 w8 p4", {"AMAX_UNROLL": 4}),
        ("b4096 u2 w8 p8", {"AMAX_UNROLL": 2, "PROGRAMS_PER_SM": 8}),
        ("b8192 u2 w8 p4", {"AMAX_BLOCK": 8192, "AMAX_UNROLL": 2}),
        ("b8192 u1 w16 p4", {"AMAX_BLOCK": 8192, "AMAX_WARPS": 16}),
        ("b4096 u4 w4 p8", {"AMAX_UNROLL": 4, "AMAX_WARPS": 4, "PROGRAMS_PER_SM": 8}),
        ("b2048 u8 w4 p8", {"AMAX_BLOCK": 2048, "AMAX_UNROLL": 8, "AMAX_WARPS": 4,
                            "PROGRAMS_PER_SM": 8}),
        ("b4096 u4 w8 p2", {"AMAX_UNROLL": 4, "PROGRAMS_PER_SM": 2}),
        ("b8192 u4 w8 p4", {"AMAX_BLOCK": 8192, "AMAX_UNROLL": 4}),
        ("b4096 u8 w8 p4", {"AMAX_UNROLL": 8}),
        ("b4096 u2 w8 p16", {"AMAX_UNROLL": 2, "PROGRAMS_PER_SM": 16}),
    ])

    # ---- per-tensor FP8 (delayed: one read, two FP8 copies; current: + amax read)
    def ptw(tm, tk, w, integer=False):  # per_tensor_tile (bf16 read as words)
        values = {"TILE_M": tm, "TILE_K": tk, "NUM_WARPS": w}
        if integer:
            values["ENV:MINIFLOAT_INTEGER_CAST"] = "1"
        return (f"{tm}x{tk} w{w}{' int' if integer else ''}", values)

    pt_variants = [ptw(64, 128, 4), ptw(64, 128, 4, integer=True), ptw(32, 256, 4),
                   ptw(64, 64, 4), ptw(32, 128, 4), ptw(64, 64, 2), ptw(128, 128, 8),
                   ptw(64, 128, 2)]
    group("pt/delayed", per_tensor_fp8, n * 4,
          lambda: per_tensor_fp8.quantize_delayed_scaling(x, scale, amax_state, e4m3),
          pt_variants)
    group("pt/current", per_tensor_fp8, n * 6,
          lambda: per_tensor_fp8.quantize_current_scaling(x, e4m3), pt_variants)
    x32_in = x.float()  # element loads: 4-byte reads (amax + cast) and two 1-byte copies
    group("pt/current fp32 in", per_tensor_fp8, n * 10,
          lambda: per_tensor_fp8.quantize_current_scaling(x32_in, e4m3),
          [ptw(64, 128, 4), ptw(64, 64, 4), ptw(32, 128, 4)])

    # ---- MXFP8 (one read; both copies in [M, K] plus scales)
    def mx(bm, bk, w, ENV_INT=None):  # v2 element kernel (WORDS off)
        values = {"BLOCK_M": bm, "BLOCK_K": bk, "NUM_WARPS": w, "WORDS": False}
        if ENV_INT:
            values["ENV:MINIFLOAT_INTEGER_CAST"] = "1"
        return (f"v2 {bm}x{bk} w{w}{' int' if ENV_INT else ''}", values)

    def mxw(bk, w, ENV_INT=None):  # v3 words kernel (bf16; 32-row tiles)
        values = {"WORDS": True, "WORDS_BLOCK_K": bk, "WORDS_NUM_WARPS": w}
        if ENV_INT:
            values["ENV:MINIFLOAT_INTEGER_CAST"] = "1"
        return (f"words 32x{bk} w{w}{' int' if ENV_INT else ''}", values)

    group("mx", mxfp8, n * (2 + 2 + 2 / 32),
          lambda: mxfp8.quantize_mxfp8(x, rowwise=True, columnwise=True), [
              mx(32, 128, 2), mxw(128, 2), mxw(128, 2, ENV_INT="1"), mxw(64, 1), mxw(128, 4),
              mxw(256, 4), mxw(256, 2), mxw(128, 1), mxw(64, 2), mxw(512, 8), mx(32, 128, 2),
          ])

    # ---- block FP8 (the one kernel: bf16 read as words; fp32 read as elements)
    def blk(w, dims="1D", integer=False):
        values = {f"NUM_WARPS_{dims}": w}
        if integer:
            values["ENV:MINIFLOAT_INTEGER_CAST"] = "1"
        return (f"w{w}{' int' if integer else ''}", values)

    group("blk/1x128", block_fp8, n * (2 + 2 + 8 / 128),
          lambda: block_fp8.quantize_block_1d(x), [
              blk(4), blk(8), blk(2), blk(4, integer=True), blk(4),
          ])
    group("blk/128x128", block_fp8, n * 4, lambda: block_fp8.quantize_block_2d(x), [
        blk(4, "2D"), blk(8, "2D"), blk(2, "2D"), blk(4, "2D", integer=True),
    ])
    x32 = x.float()
    group("blk/1x128 fp32 in", block_fp8, n * (4 + 2 + 8 / 128),
          lambda: block_fp8.quantize_block_1d(x32), [blk(4), blk(8)])

    # ---- NVFP4 (amax read + cast read; 1 byte of data per element both copies + scales)
    def nv(bm, bk, w, ws):
        return (f"{bm}x{bk} w{w}/sr w{ws}", {"BLOCK_M": bm, "BLOCK_K": bk, "NUM_WARPS": w,
                                              "NUM_WARPS_2D": w, "NUM_WARPS_STOCHASTIC": ws})

    nv_variants = [nv(64, 64, 8, 8), nv(64, 64, 4, 8), nv(64, 64, 8, 16), nv(32, 64, 4, 4),
                   nv(64, 32, 4, 4), nv(32, 128, 4, 8), nv(64, 128, 8, 8), nv(64, 64, 2, 4)]
    nv_floor = n * (4 + 1 + 2 / 16)
    group("nv/amax-only", nvfp4, n * 2,
          lambda: nvfp4.quantize_nvfp4(x, rowwise=False, columnwise=False), nv_variants[:2])
    group("nv/rht", nvfp4, nv_floor,
          lambda: nvfp4.quantize_nvfp4(x, rowwise=True, columnwise=True, with_rht=True),
          nv_variants)
    def nvw(bm, bk, w, integer=False):  # 2D words kernel (bf16; nvfp4_words.py)
        values = {"WORDS_2D": True, "WORDS_BLOCK_M_2D": bm, "WORDS_BLOCK_K_2D": bk,
                  "WORDS_NUM_WARPS_2D": w}
        if integer:
            values["ENV:MINIFLOAT_INTEGER_CAST"] = "1"
        return (f"words {bm}x{bk} w{w}{' int' if integer else ''}", values)

    old_2d = ("v2 64x64 w2", {"WORDS_2D": False})
    group("nv/2d", nvfp4, nv_floor,
          lambda: nvfp4.quantize_nvfp4(x, rowwise=True, columnwise=True, two_dimensional=True),
          [old_2d, nvw(16, 512, 2), nvw(16, 256, 1), nvw(16, 1024, 4), nvw(32, 256, 2),
           nvw(64, 128, 2), nvw(16, 512, 2, integer=True), old_2d])
    group("nv/sr", nvfp4, nv_floor,
          lambda: nvfp4.quantize_nvfp4(x, rowwise=True, columnwise=True,
                                       stochastic_rounding=True), nv_variants, seeded=True)

    print(f"\ncopy {copy_ms:.3f} ms = {copy_bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()};"
          f" {args.rows}x{args.cols} bf16; sweep {time.time() - start:.0f} s")
    print(f"{'group':14s} {'variant':34s} {'ms':>7s} {'GB/s':>6s} {'xcopy':>6s}  bytes")
    for row in rows:
        if len(row) == 5:
            title, label, ms, same, bw = row
            print(f"{title:14s} {label:34s} {ms:7.3f} {bw / 1e9:6.0f} {bw / copy_bw:6.3f}  {same}")
        else:
            print(f"{row[0]:14s} {row[1]:34s} {'':7s} {'':6s} {'':6s}  {row[3]}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.json").write_text(json.dumps(
            {"copy_ms": copy_ms, "copy_GBps": copy_bw / 1e9, "rows": rows}, indent=1,
            default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
