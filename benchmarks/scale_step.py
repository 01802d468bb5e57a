"""FSDP2 training step on N GPUs: tokens/s per GPU against plain bf16 and torchao (issue 18).

Why: a multi-GPU user shards the model with FSDP2 (torch.distributed.fsdp.fully_shard), and the
weight all-gathers then cost time and memory that a one-GPU step does not show. Low-precision
all-gather (minifloat.distributed.enable_low_precision_all_gather; torchao's
enable_fsdp_float8_all_gather) moves one byte per weight element instead of two. Every row trains
the same plain-PyTorch model (minifloat.models.torch_gpt, bf16 parameters, LM head kept in bf16,
fused AdamW over the sharded parameters), each block and then the root sharded over all ranks
of one mesh, each rank on its own random token batches (data parallel):

  bf16-eager, bf16-compiled                  plain PyTorch (compiled: each block compiled)
  torchao-fp8-gather-compiled                torchao.float8 tensorwise with FP8 all-gather and
                                             precompute_float8_dynamic_scale_for_fsdp after
                                             each optimizer step, each block compiled
  fp8-current-bf16-gather-eager / -compiled   minifloat FP8 current scaling; FSDP2 gathers bf16
  fp8-current-fp8-gather-eager / -compiled   the same with FP8 all-gather
  mxfp8-lp-gather-eager, nvfp4-lp-gather-eager  MXFP8 / NVFP4 weights gathered quantized (on
                                             Hopper their GEMMs are emulated: see BENCHMARKS.md)
  bf16[-compiled]-graphed, fp8-current-{bf16,fp8}-gather[-compiled]-graphed,
  {mxfp8,nvfp4}-lp-gather-graphed
                                             the whole step (forward, backward, collectives,
                                             optimizer) captured as one CUDA graph after two
                                             eager steps and replayed
                                             (minifloat.make_graphed_step)
  fp8-current-bf16-gather-compiled-ops       the compiled rows without CUDA graphs take the
                                             casts in the traced graph by default
                                             (minifloat.modules.graph_casts); this row forces
                                             gemm_op's ops instead, to compare the two

Measured per row (after --warmup steps), on every rank, reported for rank 0 with the slowest
rank's median alongside:
- ms_per_step: median of --steps steps, each timed by CUDA events around it;
  tokens_per_s_per_gpu: the rank's batch tokens / that time.
- peak_gib: max over ranks of torch.cuda.max_memory_allocated (reset before the row is built).
- steady_peak_gib: this rank's peak over the timed steps alone (the statistics reset after the
  warmup steps), so a peak that compilation or the first steps set shows as the difference.
- all_gather_bytes / reduce_scatter_bytes: the output bytes of the all-gathers / input bytes of
  the reduce-scatters of the first step on rank 0 (minifloat.distributed.count_collective_bytes;
  eager in every row: a -graphed row's replays call no Python).
- all_gather_ms / reduce_scatter_ms: summed GPU time of NCCL AllGather / ReduceScatter kernels in
  one step under torch.profiler (they overlap compute, so they are not step time).
- speedup_vs_bf16_eager / _compiled; weak_scaling_efficiency: this row's tokens/s per GPU over the
  same row's in a one-GPU result file of the same GPU and preset in --out (run the one-GPU case
  first: scripts/gpu-multi does).

--host-profile DIR (why a step's host time grows with the world size: on 4 H100s minifloat's
FP8 rows took 185-207 ms of host time a step against 117 on one GPU, plain bf16 94 against 70)
appends, per rank, to DIR/host_rank<r>.txt: the synchronizing CUDA calls one step makes
(torch.cuda.set_sync_debug_mode's warnings, a sync inside the step turns GPU waits on other
ranks into host time) and a cProfile of another step, top functions by own time and by
cumulative time.

--blocks-per-unit N shards N consecutive blocks as one FSDP2 unit (fully_shard of a list). Why:
at 1b every row is host-bound under FSDP2, and the twelfth session's profiles (4 x H100) found no
synchronizing call and no Python that grows with the world size beyond FSDP2's own per-unit
collectives and hooks; fewer units mean fewer of them a step, at the cost of larger gathers.

Usage (one process per GPU):
  torchrun --standalone --nproc-per-node N benchmarks/scale_step.py [--preset 1b]
      [--rows bf16-eager,...] [--steps 10] [--warmup 3] [--out DIR] [--host-profile DIR]
      [--blocks-per-unit N] [--keep-gathered]
Writes DIR/scale_step_<gpu>_<preset>_n<N>[_u<N>][_kept].json (default DIR benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_step  # noqa: E402

from minifloat.models.torch_gpt import PRESETS, TorchGPTConfig, not_head  # noqa: E402

ROWS = {  # name: (kind, low-precision all-gather, compiled)
    "bf16-eager": ("bf16", False, False),
    "bf16-compiled": ("bf16", False, True),
    "torchao-fp8-gather-compiled": ("torchao", True, True),
    "fp8-current-bf16-gather-eager": ("fp8-current", False, False),
    "fp8-current-bf16-gather-compiled": ("fp8-current", False, True),
    "fp8-current-fp8-gather-eager": ("fp8-current", True, False),
    "fp8-current-fp8-gather-compiled": ("fp8-current", True, True),
    "mxfp8-lp-gather-eager": ("mxfp8", True, False),
    "nvfp4-lp-gather-eager": ("nvfp4", True, False),
}
OPS = "-ops"
GRAPHED = "-graphed"
# every row but torchao's, its steps captured whole as one CUDA graph (minifloat.
# make_graphed_step): <row>-graphed for the eager rows (-eager dropped), compiled ones alike
ROWS.update({name.removesuffix("-eager") + GRAPHED: spec for name, spec in ROWS.items()
             if spec[0] != "torchao"})
# gemm_op's ops instead of the graph casts (minifloat.modules.graph_casts) in the row's steps
ROWS["fp8-current-bf16-gather-compiled-ops"] = ("fp8-current", False, True)


@dataclasses.dataclass
class ShardedStep:
    """One data-parallel training step of an FSDP2-sharded model."""

    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    recipe: object | None = None
    after_optimizer: Callable[[], None] | None = None
    graph_casts: bool | None = None  # None: the library's choice

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        with model_step.recipe_context(self.recipe, self.graph_casts):
            loss = self.loss_fn(tokens)
        loss.backward()
        self.optimizer.step()
        if self.after_optimizer is not None:
            self.after_optimizer()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def build_row(name: str, config: TorchGPTConfig, device: str, mesh,
              blocks_per_unit: int = 1, reshard_after_forward: bool = True
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The row's model: converted, maybe compiled per block, sharded in units of
    blocks_per_unit consecutive blocks (fully_shard of a list: one all-gather, one
    reduce-scatter and one set of hooks per unit)."""
    from torch.distributed.fsdp import fully_shard

    kind, low_precision_gather, compiled = ROWS[name]
    model = model_step.build_model(config, device)  # the same seed on every rank
    recipe, after_optimizer = None, None
    if kind == "torchao":
        try:
            from torchao.float8 import (
                Float8LinearConfig,
                convert_to_float8_training,
                precompute_float8_dynamic_scale_for_fsdp,
            )
        except ImportError as error:
            raise model_step.RowSkipped(f"torchao is not importable ({error})") from None
        ao_config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"),
                                        enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=ao_config,
                                   module_filter_fn=lambda module, fqn: not_head(fqn, module))

        def after_optimizer() -> None:
            precompute_float8_dynamic_scale_for_fsdp(model)
    elif kind != "bf16":
        import minifloat as mf
        from minifloat.distributed import enable_low_precision_all_gather

        recipe = model_step.minifloat_recipe(kind)
        mf.convert_model(model, recipe=recipe, filter_fn=not_head)
        if low_precision_gather:
            enable_low_precision_all_gather(model, recipe)
    blocks = list(model.blocks)
    if compiled:
        for block in blocks:
            block.compile()
    for first in range(0, len(blocks), blocks_per_unit):
        unit = blocks[first:first + blocks_per_unit]
        fully_shard(unit[0] if len(unit) == 1 else unit, mesh=mesh,
                    reshard_after_forward=reshard_after_forward)
    # The root's hooks gather the embeddings, final norm and head: FSDP2 runs them around a
    # module call, so the loss (model.loss calls forward directly) is wrapped as one.
    root = fully_shard(model_step.LossOf(model), mesh=mesh)
    graphed = name.endswith(GRAPHED)
    if graphed and device != "cuda":
        raise model_step.RowSkipped("CUDA-graph capture needs CUDA")
    # fused (torch's fastest AdamW, model_step's too; FSDP2's DTensors take it), capturable
    # where the step is captured
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=graphed)
    step = ShardedStep(model, root, optimizer, recipe, after_optimizer,
                       graph_casts=False if name.endswith(OPS) else None)
    if graphed:
        from minifloat import make_graphed_step

        return make_graphed_step(step, num_warmup_iters=2)
    return step


def collective_kernel_ms(step: ShardedStep, tokens: torch.Tensor,
                         profile_file: Path | None = None) -> dict:
    """GPU ms of NCCL all-gather / reduce-scatter kernels in one profiled step (and, given a
    file, the step's top operators by host time and by GPU time, written there)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(tokens)
        torch.cuda.synchronize()
    if profile_file is not None:
        averages = prof.key_averages()
        profile_file.write_text(
            averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
            + "\n\n" + averages.table(sort_by="self_device_time_total", row_limit=30,
                                       max_name_column_width=70))
    times = {"all_gather_ms": 0.0, "reduce_scatter_ms": 0.0, "kernels_per_step": 0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        times["kernels_per_step"] += not event.name.startswith(("Memcpy", "Memset"))
        if "AllGather" in event.name:
            times["all_gather_ms"] += event.device_time / 1000
        elif "ReduceScatter" in event.name:
            times["reduce_scatter_ms"] += event.device_time / 1000
    return times


def measure(step: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], warmup: int,
            steps: int, device: str, profile_file: Path | None = None) -> dict:
    from minifloat.distributed import count_collective_bytes

    result: dict = {}
    model_step._sync(device)
    start = time.perf_counter()
    # the first step is eager Python in every row (a -graphed row's replays call no Python)
    with count_collective_bytes() as moved:
        result["first_loss"] = float(step(batches[0]).item())
    result["first_step_s"] = time.perf_counter() - start
    result.update(all_gather_bytes=moved["all_gather_output_bytes"],
                  reduce_scatter_bytes=moved["reduce_scatter_input_bytes"])
    for tokens in batches[1:warmup]:
        step(tokens)
    if device == "cuda":  # the first steps' peak (compilation, autotuning) apart from steady state
        torch.cuda.synchronize()
        first_steps_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms, loss = model_step._timed_steps(step, batches[warmup:warmup + steps], device)
    if device == "cuda":
        result["steady_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result.update(ms_per_step=statistics.median(ms), ms_steps=ms, final_loss=float(loss.item()))
    # host ms: the step's Python from an empty GPU queue to its return (model_step.host_times)
    result["host_ms"] = statistics.median(
        model_step.host_times(step, batches[warmup:warmup + min(steps, 3)], device))
    if device == "cuda":
        result.update(collective_kernel_ms(step, batches[warmup + steps], profile_file))
        result["peak_gib"] = max(first_steps_peak, torch.cuda.max_memory_allocated()) / 2**30
    return result


def host_profile(step: ShardedStep, batches: list[torch.Tensor], device: str, name: str,
                 folder: Path) -> int:
    """Append this rank's synchronizing calls in one step and a cProfile of another to
    folder/host_rank<r>.txt; returns the number of synchronizing calls."""
    import cProfile
    import io
    import pstats
    import warnings

    syncs: list[str] = []
    if device == "cuda":
        model_step._sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(batches[0])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{str(w.message).splitlines()[0]} at {w.filename}:{w.lineno}"
                 for w in caught if "synchroniz" in str(w.message)]
    model_step._sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    step(batches[1])
    profiler.disable()
    model_step._sync(device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)  # which callers the own times add up under
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"host_rank{dist.get_rank()}.txt", "a") as file:
        file.write(f"==== {name}: {len(syncs)} synchronizing calls in one step\n")
        for message in sorted(set(syncs)):
            file.write(f"  {syncs.count(message)} x {message}\n")
        file.write(text.getvalue())
    return len(syncs)


def run_row(name: str, config: TorchGPTConfig, batches: list[torch.Tensor], warmup: int,
            steps: int, mesh, device: str, profile_dir: Path | None = None,
            host_profile_dir: Path | None = None, blocks_per_unit: int = 1,
            reshard_after_forward: bool = True) -> dict:
    """One row on every rank; failures are recorded (the same on every rank, or the run hangs)."""
    row: dict = {"row": name}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step = None
    try:
        step = build_row(name, config, device, mesh, blocks_per_unit, reshard_after_forward)
        profile_file = None
        if profile_dir is not None and dist.get_rank() == 0:
            profile_dir.mkdir(parents=True, exist_ok=True)
            profile_file = profile_dir / f"{name}.txt"
        row.update(measure(step, batches, warmup, steps, device, profile_file))
        if host_profile_dir is not None:
            row["synchronizing_calls"] = host_profile(step, batches[warmup + steps:], device,
                                                      name, host_profile_dir)
    except model_step.RowSkipped as skipped:
        row["skipped"] = str(skipped)
    except Exception as error:  # noqa: BLE001 - recorded in the row, the run goes on
        row["error"] = model_step._error_text(error)
        row["traceback"] = "".join(traceback.format_exception(error))[-6000:]
        print(f"{name} failed on rank {dist.get_rank()}:\n{row['traceback']}", file=sys.stderr)
        error.__traceback__ = None
    step = None  # noqa: F841 - frees the model before the next row
    model_step._free(device)
    return row


def across_ranks(row: dict, device: str) -> None:
    """Slowest rank's median step time and the largest peak memory, into rank 0's row."""
    values = torch.tensor([row.get("ms_per_step", float("nan")), row.get("peak_gib") or 0.0],
                          device=device, dtype=torch.float64)
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    stacked = torch.stack(gathered).cpu()
    if "ms_per_step" in row:
        row["ms_per_step_slowest_rank"] = float(stacked[:, 0].max())
        if device == "cuda":
            row["peak_gib"] = float(stacked[:, 1].max())


def add_ratios(rows: list[dict], tokens_per_step: int, one_gpu: dict[str, float]) -> None:
    by_name = {row["row"]: row for row in rows}
    for row in rows:
        ms = row.get("ms_per_step")
        if not ms:
            continue
        row["tokens_per_s_per_gpu"] = tokens_per_step / (ms / 1000)
        for key in ("bf16-eager", "bf16-compiled"):
            base = by_name.get(key, {}).get("ms_per_step")
            row[f"speedup_vs_{key.replace('-', '_')}"] = base / ms if base else None
        single = one_gpu.get(row["row"])
        row["weak_scaling_efficiency"] = row["tokens_per_s_per_gpu"] / single if single else None


def table(data: dict) -> str:
    lines = [f"{data['world_size']} x {data['device']}, preset {data['preset']}, torch "
             f"{data['versions']['torch']}", "",
             "| row | ms/step | host ms | tokens/s/GPU | vs bf16 eager | vs bf16 compiled | "
             "weak scaling | peak GiB | steady peak GiB | all-gather MB | all-gather ms | "
             "reduce-scatter ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(value, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    for row in data["rows"]:
        if "ms_per_step" not in row:
            lines.append(f"| {row['row']} | {row.get('skipped') or 'failed: ' + row['error']} "
                         "| | | | | | | | | | |")
            continue
        lines.append(
            f"| {row['row']} | {row['ms_per_step']:.2f} | {cell(row.get('host_ms'), '.1f')} | "
            f"{row['tokens_per_s_per_gpu']:.0f} | "
            f"{cell(row.get('speedup_vs_bf16_eager'), '.2f')} | "
            f"{cell(row.get('speedup_vs_bf16_compiled'), '.2f')} | "
            f"{cell(row.get('weak_scaling_efficiency'), '.2f')} | "
            f"{cell(row.get('peak_gib'), '.1f')} | {cell(row.get('steady_peak_gib'), '.1f')} | "
            f"{row['all_gather_bytes'] / 1e6:.1f} | "
            f"{cell(row.get('all_gather_ms'), '.1f')} | "
            f"{cell(row.get('reduce_scatter_ms'), '.1f')} |")
    return "\n".join(lines)


def one_gpu_rates(folder: Path, slug: str, preset: str, suffix: str = "") -> dict[str, float]:
    """Each row's tokens/s in the one-GPU result file of the same settings (suffix: _u<N>,
    _kept), if it is there."""
    path = folder / f"scale_step_{slug}_{preset}_n1{suffix}.json"
    if not path.exists():
        return {}
    return {row["row"]: row["tokens_per_s_per_gpu"]
            for row in json.loads(path.read_text())["rows"] if "tokens_per_s_per_gpu" in row}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=list(PRESETS))
    parser.add_argument("--rows", default=",".join(ROWS), help="comma list of: " + ", ".join(ROWS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=model_step.RESULTS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo, for smoke tests of the script (times mean nothing)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="write each row's top operators (host and GPU time) there")
    parser.add_argument("--blocks-per-unit", type=int, default=1, metavar="N",
                        help="shard N consecutive blocks as one FSDP2 unit (default 1: each "
                             "block); fewer units, fewer hooks and collectives a step")
    parser.add_argument("--host-profile", type=Path, default=None, metavar="DIR",
                        help="per rank: synchronizing calls of a step and a cProfile of one")
    parser.add_argument("--keep-gathered", action="store_true",
                        help="fully_shard(reshard_after_forward=False) for every row: backward "
                             "reuses forward's gathered weights instead of gathering again "
                             "(more memory, a gather less a unit)")
    args = parser.parse_args(argv)
    if args.blocks_per_unit < 1:
        parser.error(f"--blocks-per-unit must be at least 1, got {args.blocks_per_unit}")
    names = [name for name in args.rows.split(",") if name]
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: torchrun --standalone --nproc-per-node N "
                     "benchmarks/scale_step.py ...")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("scale_step: no CUDA device; skipped (--device cpu runs a smoke test)",
              file=sys.stderr)
        return 0
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device, (world,))
    config = PRESETS[args.preset]
    batches = model_step.make_batches(config, args.warmup + args.steps + 2, device,
                                      seed=model_step.SEED + rank)
    env = model_step.environment(device)
    data = {"benchmark": "scale_step", **env, "world_size": world, "preset": args.preset,
            "config": dataclasses.asdict(config), "steps": args.steps, "warmup": args.warmup,
            "blocks_per_unit": args.blocks_per_unit, "keep_gathered": args.keep_gathered,
            "rows": []}
    slug = model_step.device_slug(env)
    suffix = (f"_u{args.blocks_per_unit}" if args.blocks_per_unit > 1 else "") + (
        "_kept" if args.keep_gathered else "")
    out = args.out / f"scale_step_{slug}_{args.preset}_n{world}{suffix}.json"
    for name in names:
        row = run_row(name, config, batches, args.warmup, args.steps, mesh, device,
                      args.profile_dir, args.host_profile, args.blocks_per_unit,
                      not args.keep_gathered)
        across_ranks(row, device)
        if rank == 0:
            data["rows"].append(row)
            add_ratios(data["rows"], config.batch_size * config.seq_len,
                       one_gpu_rates(args.out, slug, args.preset, suffix) if world > 1 else {})
            args.out.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=2))
            print(f"{name}: {row.get('ms_per_step', row.get('error') or row.get('skipped'))}",
                  flush=True)
    if rank == 0:
        print(table(data))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
