"""The MoE grouped GEMMs on device-side group offsets against torch's grouped kernels.

Why: FusedExperts' device-offsets path (modules/grouped_offsets.py) runs its three GEMMs per
expert projection on minifloat's Triton kernels (kernels/grouped_gemm.py), the only grouped
kernels that take HYBRID's E5M2 gradients. This times them, in one process, against what a user
has otherwise at the same shapes: torch._grouped_mm in bf16 (transformers' experts on CUDA) and
torch._scaled_grouped_mm (E4M3 only, CUTLASS) for the forward GEMM.

Rows per projection (gate_up: x [R, D] -> [R, 2F]; down: [R, F] -> [R, D]):
  fprop  bf16 _grouped_mm | _scaled_grouped_mm E4M3 | Triton E4M3 x E4M3 (fast accumulation)
  dgrad  bf16 _grouped_mm | Triton E5M2 x E4M3 (split accumulation)
  wgrad  bf16 _grouped_mm (2d x 2d) | Triton E5M2 x E4M3 (split accumulation)
  cast   the grouped cast of x and of dy (both copies) as a share of a bf16 copy's bandwidth
Each: median of --repeats windows of BATCH launches timed by CUDA events, after --warmup;
TFLOP/s counts the routed rows only (2 * pairs * in * out). --sweep adds other GEMM and cast
tiles; --bands 1,4,16 times both kernels in other launch orders (grouped_gemm.ROWS_GROUP_M
and REDUCTION_GROUP_M: row blocks a band, default 8; 1 is row-major, the order before the
twenty-ninth session); --rounds N times everything N times over, interleaved, and reports each
setting's median and spread (one round's timings of the same setting differed by 13% on an H100:
a difference smaller than the spread is noise).
--split-depths 128,256 times the split-accumulating dgrad with 256-deep blocks at each promotion
depth (grouped_gemm.SPLIT_ACCUMULATION: the fp32 promotion every this many products; a depth
cannot exceed BLOCK_K), each row with its largest error against an fp32 product of the same FP8
operands, relative to the product's largest magnitude: what a deeper promotion would save, and
what it would cost in accuracy (the fast-accumulation rows give the other end). The wgrad is
not among them: it reduces over the groups' rows, BLOCK_K at a time, so its blocks are at most
GROUP_ROWS (128) deep and its promotion depth is already the deepest its blocks allow (a first
version ran it with 256-deep blocks, which read across group ends: an illegal address on an
H100, BENCHMARKS.md twenty-ninth session).

Usage: python benchmarks/grouped_gemm_bench.py [--tokens 8192] [--top-k 2] [--experts 8]
           [--hidden 2048] [--ffn 4096] [--sweep] [--rounds 3] [--split-depths 128,256]
           [--bands 1,4,16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minifloat.modules.grouped_offsets import routing_layout  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# the rows kernel (fprop, dgrad): (BLOCK_M <= 128: the layout contract) x BLOCK_N x BLOCK_K,
# warps, stages
SWEEP = [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 8, 5),
         # 256 wide: half the operand bytes a product; the fast-accumulating forward's
         # accumulator fits in the registers, the split accumulator's two do not
         (128, 256, 128, 8, 3),
         # 256 deep: two split-accumulator promotions a block (the same numerics), half the
         # loop steps
         (128, 128, 256, 8, 3), (128, 128, 256, 8, 2)]
# the wgrad kernel (groups outermost, grouped_gemm.REDUCTION_GROUP_MAJOR; the innermost order
# ran 1.27-1.30x slower on an H100): tiles with BLOCK_K 128, the split accumulator's interval
WGRAD_SWEEP = [(128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 8, 5)]
# --split-depths: the tile of both kernels (256 deep, two stages: four stages of 256-deep
# blocks asked for more shared memory than an H100 has)
DEEP_TILES = (128, 128, 256, 8, 2)


# launches between one pair of events: the host's Python before each launch (tens of
# microseconds for a Triton kernel, less for torch's) then overlaps the GPU's work instead of
# counting as idle time inside the window, as it did with one launch a pair
BATCH = 5


def timed_ms(fn, warmup: int, repeats: int) -> float:
    """Median over `repeats` windows of BATCH back-to-back launches, per launch."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(BATCH):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / BATCH)
    return statistics.median(times)


def fixed_tiles(tiles: tuple[int, int, int, int, int]):
    """A stand-in for grouped_gemm._tiles that returns these (BLOCK_M, BLOCK_N, BLOCK_K,
    warps, stages) whatever it is asked (the kernels pop from the dict: a fresh one a call)."""
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return lambda *_: dict(zip(names, tiles, strict=True))


def merged_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per timed setting, in the first round's order: the median of its rounds' times
    and their spread (max - min), the figure a difference between settings must exceed
    (rounds interleave the settings, so a drift of the card's speed lands in every one)."""
    times: dict[tuple, list[float]] = {}
    for round_rows in rounds:
        for row in round_rows:
            if "ms" in row:
                times.setdefault((row["projection"], row["gemm"], row["kernel"]), []).append(
                    row["ms"])
    merged = []
    for row in rounds[0]:
        ms = times.get((row["projection"], row["gemm"], row["kernel"]))
        if ms is None:
            merged.append(row)
            continue
        median = statistics.median(ms)
        extra = dict(ms=round(median, 4), spread_ms=round(max(ms) - min(ms), 4), rounds_ms=ms)
        if "tflops" in row:  # the rate of the median time
            extra["tflops"] = round(row["tflops"] * row["ms"] / median, 1)
        if "of_copy" in row:
            extra["of_copy"] = round(row["copy_ms"] / median, 3)
        merged.append(row | extra)
    return merged


def projection_rows(name: str, rows: int, pairs: int, ends: torch.Tensor, experts: int,
                    width_in: int, width_out: int, warmup: int, repeats: int,
                    gemms: tuple[str, ...] = ("fprop", "dgrad", "wgrad"),
                    triton_only: bool = False, label: str = "",
                    with_errors: bool = False) -> list[dict]:
    """Timed rows of one projection's GEMMs; with_errors adds each Triton row's relative
    error against an fp32 product of its FP8 operands (reference_products)."""
    from minifloat.kernels import grouped_gemm  # imports triton: CUDA machines only

    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, width_in, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(experts, width_out, width_in, device=device, generator=g,
                    dtype=torch.bfloat16) / width_in ** 0.5
    dy = torch.randn(rows, width_out, device=device, generator=g, dtype=torch.bfloat16)
    scales = torch.ones(experts, device=device)
    x8, w8, dy8 = x.to(E4M3), w.to(E4M3), dy.to(E5M2)
    w8_t = w8.transpose(1, 2).contiguous()
    x8_t, dy8_t = x8.t().contiguous(), dy8.t().contiguous()
    flops = 2.0 * pairs * width_in * width_out
    reduction_gemm = grouped_gemm.grouped_reduction_gemm
    cases = {
        ("fprop", "bf16 _grouped_mm"): lambda: torch._grouped_mm(x, w.transpose(1, 2),
                                                                 offs=ends),
        ("fprop", "_scaled_grouped_mm E4M3"): lambda: torch._scaled_grouped_mm(
            x8, w8.transpose(1, 2), torch.ones(rows, device=device),
            torch.ones(experts, width_out, device=device), offs=ends,
            out_dtype=torch.bfloat16, use_fast_accum=True),
        ("fprop", "triton E4M3xE4M3"): lambda: grouped_gemm.grouped_rows_gemm(
            x8, w8, scales, scales, ends, torch.bfloat16, precise=False),
        ("dgrad", "bf16 _grouped_mm"): lambda: torch._grouped_mm(dy, w, offs=ends),
        ("dgrad", "triton E5M2xE4M3"): lambda: grouped_gemm.grouped_rows_gemm(
            dy8, w8_t, scales, scales, ends, torch.bfloat16, precise=True),
        # a bound, not a setting: what the split accumulator costs the dgrad
        ("dgrad", "triton E5M2xE4M3 fast accumulation"): lambda: grouped_gemm.grouped_rows_gemm(
            dy8, w8_t, scales, scales, ends, torch.bfloat16, precise=False),
        ("wgrad", "bf16 _grouped_mm"): lambda: torch._grouped_mm(dy.t(), x, offs=ends),
        ("wgrad", "triton E5M2xE4M3"): lambda: grouped_gemm.grouped_reduction_gemm(
            dy8_t, x8_t, scales, scales, ends, torch.bfloat16, precise=True),
        ("wgrad", "triton E5M2xE4M3 fast accumulation"): lambda: reduction_gemm(
            dy8_t, x8_t, scales, scales, ends, torch.bfloat16, precise=False),
    }
    references = (reference_products(x8, w8, dy8, ends, experts) if with_errors else {})
    results = []
    for (gemm, kernel), fn in cases.items():
        if gemm not in gemms or (triton_only and not kernel.startswith("triton")):
            continue
        try:
            ms = timed_ms(fn, warmup, repeats)
            extra = {}
            if gemm in references and kernel.startswith("triton"):
                reference = references[gemm]
                extra["max_rel_error"] = float((fn().float() - reference).abs().max()
                                               / reference.abs().max())
        except Exception as error:  # noqa: BLE001 - a kernel a torch build lacks: say so
            results.append(dict(projection=name, gemm=gemm, kernel=kernel, error=str(error)))
            continue
        results.append(dict(projection=name, gemm=gemm, kernel=kernel + label, ms=round(ms, 4),
                            tflops=round(flops / ms / 1e9, 1), **extra))
        print(json.dumps(results[-1]), flush=True)  # as it goes: a run cut short keeps its rows
    return results


def reference_products(x8: torch.Tensor, w8: torch.Tensor, dy8: torch.Tensor,
                       ends: torch.Tensor, experts: int) -> dict[str, torch.Tensor]:
    """fp32 products of the FP8 operands, group by group (unit scales, as the timed calls):
    dgrad [rows, in] = dy_e @ w_e and wgrad [experts, out, in] = dy_e^T @ x_e. An fp32 GEMM
    rounds too, but at 2^-24 a sum, far below what an FP8 accumulator order moves."""
    bounds = [0, *ends.tolist()]
    dgrad = torch.zeros(x8.shape, device=x8.device)
    wgrad = torch.zeros(w8.shape, device=x8.device)
    for e in range(experts):
        first, last = bounds[e], bounds[e + 1]
        if last > first:
            dy_e = dy8[first:last].float()
            dgrad[first:last] = dy_e @ w8[e].float()
            wgrad[e] = dy_e.t() @ x8[first:last].float()
    return {"dgrad": dgrad, "wgrad": wgrad}


def cast_rows(name: str, rows: int, ends: torch.Tensor, experts: int, width: int, warmup: int,
              repeats: int, tile: tuple[int, int, int] | None = None) -> list[dict]:
    """The grouped cast of a [rows, width] bf16 operand (both copies: 2 bytes read, 1 + 1
    written per element) against a bf16 copy of it (2 + 2: the same bytes moved)."""
    # imports triton: CUDA machines only
    from minifloat.kernels import grouped_cast, per_tensor_fp8

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, width, device="cuda", generator=g, dtype=torch.bfloat16)
    scales = torch.full((experts,), 3.0, device="cuda")
    # the grouped cast casts with the dense per-tensor casts' tile (per_tensor_fp8's settings)
    settings = ("TILE_M", "TILE_K", "NUM_WARPS")
    default = tuple(getattr(per_tensor_fp8, setting) for setting in settings)
    for setting, value in zip(settings, tile or default, strict=True):
        setattr(per_tensor_fp8, setting, value)
    try:
        cast_ms = timed_ms(lambda: grouped_cast.grouped_cast(
            x, scales, ends, E4M3, rowwise=True, columnwise=True), warmup, repeats)
    finally:
        for setting, value in zip(settings, default, strict=True):
            setattr(per_tensor_fp8, setting, value)
    copy_ms = timed_ms(lambda: x.clone(), warmup, repeats)
    label = "triton grouped cast" + (f" tile {tile[0]}x{tile[1]} w{tile[2]}" if tile else "")
    row = dict(projection=name, gemm="cast", kernel=label, ms=round(cast_ms, 4),
               of_copy=round(copy_ms / cast_ms, 3), copy_ms=round(copy_ms, 4))
    print(json.dumps(row), flush=True)  # as it goes, as projection_rows does
    return [row]


# grouped cast tiles: (BLOCK_M dividing 128, BLOCK_K, warps); the default is the dense
# casts' 64 x 128, 4 warps
CAST_SWEEP = [(32, 128, 4), (64, 64, 4), (128, 128, 8), (64, 128, 8)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the Triton kernels under other tile settings")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every setting this many times, interleaved; report the "
                             "median and the spread")
    parser.add_argument("--split-depths", default="",
                        help="comma list of promotion depths to time the split-accumulating "
                             "dgrad at (256-deep blocks), with its errors")
    parser.add_argument("--bands", default="",
                        help="comma list of band heights (row blocks) to time both kernels' "
                             "launch orders at, besides the default")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.split_depths.split(",") if d]
    bands = [int(b) for b in args.bands.split(",") if b]
    if any(b <= 0 for b in bands):
        parser.error("--bands: each band height at least 1 (row blocks)")
    if any(d <= 0 or d > DEEP_TILES[2] for d in depths):
        parser.error(f"--split-depths: each depth in 1..{DEEP_TILES[2]} (the blocks' depth)")
    if not torch.cuda.is_available():
        print("grouped_gemm_bench: needs CUDA")
        return 0
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k]
                         for _ in range(args.tokens)]).cuda()
    layout = routing_layout(index, args.experts)
    rows, pairs = layout.pair_of_row.shape[0], args.tokens * args.top_k
    projections = (("gate_up", args.hidden, 2 * args.ffn), ("down", args.ffn, args.hidden))
    # the operands the experts' casts read: x of each projection, and its gradient dy
    cast_widths = {"x gate_up": args.hidden, "x down": args.ffn,
                   "dy gate_up": 2 * args.ffn, "dy down": args.hidden}
    from minifloat.kernels import grouped_gemm

    def projections_timed(gemms: tuple[str, ...] = ("fprop", "dgrad", "wgrad"),
                          triton_only: bool = False, label: str = "",
                          with_errors: bool = False) -> list[dict]:
        timed = []
        for name, width_in, width_out in projections:
            timed += projection_rows(name, rows, pairs, layout.ends, args.experts, width_in,
                                     width_out, args.warmup, args.repeats, gemms, triton_only,
                                     label, with_errors)
        return timed

    def one_round() -> list[dict]:
        # the settings below are patched for their own rows and restored (mock.patch.object)
        rows_timed = projections_timed()
        for tile in [None, *(CAST_SWEEP if args.sweep else ())]:
            for name, width in cast_widths.items():
                rows_timed += cast_rows(name, rows, layout.ends, args.experts, width,
                                        args.warmup, args.repeats, tile)
        for sweep, gemms in ((SWEEP, ("fprop", "dgrad")), (WGRAD_SWEEP, ("wgrad",))):
            for tiles in sweep if args.sweep else ():
                with mock.patch.object(grouped_gemm, "_tiles", fixed_tiles(tiles)):
                    rows_timed += projections_timed(
                        gemms, True, " tiles {}x{}x{} w{} s{}".format(*tiles))
        for band in bands:
            with (mock.patch.object(grouped_gemm, "ROWS_GROUP_M", band),
                  mock.patch.object(grouped_gemm, "REDUCTION_GROUP_M", band)):
                rows_timed += projections_timed(label=f" blocks in bands of {band}",
                                                triton_only=True)
        for depth in depths:
            with (mock.patch.object(grouped_gemm, "SPLIT_ACCUMULATION", depth),
                  mock.patch.object(grouped_gemm, "_tiles", fixed_tiles(DEEP_TILES))):
                rows_timed += projections_timed(
                    ("dgrad",), True, " split {} tiles {}x{}x{} w{} s{}".format(
                        depth, *DEEP_TILES), with_errors=True)
        return rows_timed

    results = merged_rounds([one_round() for _ in range(args.rounds)])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens x "
          f"top-{args.top_k} over {args.experts} experts ({rows} padded rows), d {args.hidden},"
          f" ffn {args.ffn}\n")
    print("| projection | GEMM | kernel | ms | spread ms | TFLOP/s or of copy | max rel error |\n"
          "|---|---|---|---:|---:|---:|---:|")
    for row in results:
        error = row.get("max_rel_error")
        print(f"| {row['projection']} | {row['gemm']} | {row['kernel']} | "
              f"{row.get('ms', row.get('error', ''))} | {row.get('spread_ms', '')} | "
              f"{row.get('tflops', row.get('of_copy', ''))} | "
              f"{'' if error is None else f'{error:.2e}'} |")
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                            torch=torch.__version__, args=vars(args) | dict(
                                                out=str(args.out)), rows=results), indent=1))
    return 1 if any("error" in row for row in results if row["kernel"].startswith("triton"))\
        else 0


if __name__ == "__main__":
    raise SystemExit(main())
