"""Model training step against plain PyTorch: the honest end-to-end baseline (issue 15).

Why: a speed-up claimed against minifloat's own modules run without a recipe hides what a user
would get from PyTorch alone. Every row here trains the same plain-PyTorch model
(minifloat.models.torch_gpt: nn.Linear, nn.RMSNorm, F.gelu, SDPA; bf16 parameters; fused AdamW)
in one process, from the same seed (equal initial weights) on the same random token batches:

  bf16-eager, bf16-compiled              plain PyTorch, eager and torch.compile (default mode)
  torchao-tensorwise-compiled            torchao.float8 convert_to_float8_training, tensorwise
                                         recipe, LM head kept in bf16, compiled (skipped with a
                                         message when torchao does not import)
  <recipe>-eager, <recipe>-compiled      minifloat.convert_model(model, recipe, filter_fn keeping
                                         the LM head in bf16), steps under minifloat.autocast;
                                         recipe in fp8-current, fp8-delayed, fp8-block, mxfp8,
                                         nvfp4
  <recipe>-lowmem-<mode>                 the recipe with minifloat's memory options: the modules
                                         keep their high-precision inputs and no weight copies
                                         for backward (save_original_inputs,
                                         rebuild_weight_copies_in_backward; under torch.compile
                                         the norm and GELU outputs are then recomputed in
                                         backward instead of kept, as torchao's are)
  fp8-current[-lowmem]-graphcasts-<mode>  the same with the casts in the traced graph
                                         (minifloat.modules.graph_casts, switched on for the
                                         row's steps, as they are by default for compiles
                                         without CUDA graphs; MINIFLOAT_GRAPH_CASTS=1 does it
                                         for all)
  fp8-current-offsets-<mode>             a MoE's experts on the device-offsets path in eager
                                         steps too (minifloat.modules.fused_experts, mode
                                         `always`; compiled steps take it by default)
  <any>-compiled-reduce-overhead         the same with torch.compile(mode="reduce-overhead")
                                         (--compile-mode reduce-overhead|both adds them)
  <kind>-graphed                         eager, forward+loss+backward captured as CUDA graphs
                                         (bf16: torch.cuda.make_graphed_callables; a recipe:
                                         minifloat.make_graphed_callables); the optimizer runs
                                         eagerly; capture happens before the row's first step
  <kind>[-compiled]-stepgraphed          the whole step (forward, backward, optimizer) run
                                         eagerly (or compiled, default mode) twice, then
                                         captured as one CUDA graph and replayed
                                         (minifloat.make_graphed_step)

One step = forward and cross-entropy loss (under torch.compile when compiled: the model's loss
method is compiled, loss included), backward, fused AdamW step, zero_grad(set_to_none=True). A
row that fails (e.g. minifloat under torch.compile) records its error and the run goes on.

Measured per row, after --warmup steps (compilation happens there; its wall time is
first_step_s):
- ms_per_step: median over --steps steps run back to back, each timed by CUDA events recorded
  around it (on the CPU: perf_counter around each step, which is synchronous there).
- speedup_vs_bf16_eager / _compiled: that baseline's ms_per_step / this row's (>1 = faster).
- host_ms: median over --steps further steps of the host wall time of one step: synchronize
  (the GPU queue is empty, so no launch waits for room), perf_counter, the step's Python up to
  the return of its last call (optimizer.zero_grad), perf_counter; nothing synchronizes inside
  the step unless the step itself does (such a wait is then part of its host time).
- kernels_per_step: CUDA kernel events (memcpy/memset counted apart) in one step profiled with
  torch.profiler after the timed steps.
- peak_gib: torch.cuda.max_memory_allocated after the timed steps, the peak statistics reset
  before the row's model is built (so the first steps, compile and all, are included).
- host16_ms (eager rows only): host time, measured as host_ms is, of forward+loss+backward on
  16 tokens (batch 1 x 16), the shape where host cost dominates; host16_cost_vs_bf16 is it over
  bf16-eager's (the issue's target: FP8 at 1b at most 1.3x). Compiled and graphed rows skip
  it: a new shape would recompile (or need a new capture). Each forward enters autocast, a
  forward pass of its own, so under current scaling each runs the batched weight cast
  (modules/weight_cast_batch.py), as a micro-batch does; host16_step_ms (and
  host16_step_cost_vs_bf16) is the same around whole training steps (optimizer step and
  zero_grad included).

Usage:
  python benchmarks/model_step.py --preset 1b [--rows bf16-eager,fp8-current-eager,...]
      [--steps 10] [--warmup 3] [--compile-mode default|reduce-overhead|both] [--out FILE]
      [--device cuda|cpu]
--preset takes one name or a comma list (tiny, small, 1b, llama-block, and transformers models
built from configs: hf-llama-1b, hf-mixtral-moe, hf-mixtral-8x7b-2l, hf-llama-tiny,
hf-mixtral-tiny, see hf_models.py; transformers must import); --device cpu runs
everything but the CUDA-only measurements (kernels, peak memory), for smoke tests with tiny.
Default --out: benchmarks/results/model_step_<gpu>.json (e.g. model_step_h100.json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tables  # noqa: E402
from hf_models import HF_PRESETS, HFCausalLM, HFModelConfig  # noqa: E402
from model_rows import (  # noqa: E402,F401 - the row vocabulary, used here and by importers
    DEFAULT_ROWS,
    GRAPH_CASTS,
    GRAPHED,
    KINDS,
    LOW_MEMORY,
    MOE_OFFSETS,
    RECIPE_NAMES,
    REDUCE_OVERHEAD,
    STEP_GRAPHED,
    RowSpec,
    expand_rows,
    minifloat_recipe,
)

from minifloat.models.torch_gpt import PRESETS as GPT_PRESETS  # noqa: E402
from minifloat.models.torch_gpt import TorchGPT, TorchGPTConfig  # noqa: E402

# the plain-PyTorch GPT's presets and transformers models built from configs (hf_models.py)
PRESETS: dict[str, TorchGPTConfig | HFModelConfig] = {**GPT_PRESETS, **HF_PRESETS}


def not_head(name: str, module: torch.nn.Module) -> bool:
    """Every nn.Linear but the LM head is converted (the GPT's `head`, a transformers model's
    `lm_head`): its output feeds a softmax over the vocabulary, the most precision-sensitive
    GEMM, which FP8 recipes in practice leave in bf16 (torch_gpt.not_head)."""
    return name.rsplit(".", 1)[-1] not in ("head", "lm_head")

HOST16_TOKENS = 16
HOST16_REPEATS = 10
SEED = 0
RESULTS = Path(__file__).resolve().parent / "results"


def recipe_context(recipe, graph_casts: bool | None = None, moe_offsets: str | None = None
                   ) -> contextlib.AbstractContextManager:
    """What a row's forward runs under: minifloat.autocast(recipe) (nothing without a recipe),
    with the casts in the traced graph switched on (True: -graphcasts rows) or off (False), or
    left to the library (None: on wherever the compile runs without CUDA graphs), and a MoE's
    device-offsets mode (-offsets rows: `always`; None: the library's default)."""
    context = contextlib.ExitStack()
    if recipe is not None:
        import minifloat as mf
        from minifloat.modules import fused_experts
        from minifloat.modules import graph_casts as graph_casts_module

        if graph_casts is not None:
            context.enter_context(graph_casts_module.switched(graph_casts))
        if moe_offsets is not None:
            context.enter_context(fused_experts.offsets_mode(moe_offsets))
        context.enter_context(mf.autocast(recipe=recipe))
    return context


@dataclass
class TrainStep:
    """One training step of `model` and the 16-token forward+backward, as callables.

    loss_fn(tokens [B, T+1]) -> scalar loss (the model's loss method, maybe compiled); recipe:
    a minifloat recipe to run the forward under (None: no autocast). mark_step: call
    torch.compiler.cudagraph_mark_step_begin() first (reduce-overhead's CUDA graphs need it in
    training loops, so a step's outputs are not overwritten while still in use)."""

    model: torch.nn.Module
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    recipe: object | None = None
    graph_casts: bool | None = None  # True: the casts in the traced graph (None: by default)
    moe_offsets: str | None = None  # fused_experts.offsets_mode for the steps (None: default)
    mark_step: bool = False
    host16: bool = True  # whether the 16-token forward+backward is measured for this row
    keep: list = field(default_factory=list)  # objects that must outlive the step (graphs)
    # minifloat rows: what convert_model converted and skipped (a layer left in bf16 by
    # mistake, such as a MoE's experts, shows here and in the results JSON)
    conversion: dict | None = None

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with recipe_context(self.recipe, self.graph_casts, self.moe_offsets):
            loss = self.loss_fn(tokens)
        loss.backward()
        return loss

    def __call__(self, tokens: torch.Tensor, zero_grad: bool = True) -> torch.Tensor:
        loss = self.forward_backward(tokens)
        self.optimizer.step()
        if zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
        return loss


def build_model(config: TorchGPTConfig | HFModelConfig, device: str,
                dtype: torch.dtype = torch.bfloat16, seed: int = SEED) -> torch.nn.Module:
    """The plain model (bf16 parameters); the same seed gives every row equal initial weights."""
    torch.manual_seed(seed)
    if isinstance(config, HFModelConfig):
        return HFCausalLM(config, dtype=dtype, device=device)
    return TorchGPT(config, dtype=dtype, device=device)


def make_optimizer(model: torch.nn.Module, capturable: bool = False) -> torch.optim.Optimizer:
    """Fused AdamW (torch's fastest; the fused kernel exists on CUDA and on the CPU);
    capturable for the stepgraphed rows (torch refuses to capture a step without it)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)


class LossOf(torch.nn.Module):
    """model.loss as a module's forward: what CUDA-graph capture takes (the parameters become
    the graph's inputs)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.loss(tokens)


def graphed_loss(model: torch.nn.Module, recipe, sample_tokens: torch.Tensor
                 ) -> torch.nn.Module:
    """model.loss captured as CUDA graphs, forward and backward (under `recipe` if any)."""
    if not sample_tokens.is_cuda:
        raise RowSkipped("graphed rows capture CUDA graphs and need a CUDA device")
    if recipe is None:
        return torch.cuda.make_graphed_callables(LossOf(model), (sample_tokens,))
    import minifloat as mf

    return mf.make_graphed_callables(LossOf(model), (sample_tokens,), recipe=recipe)


def prepare_row(spec: RowSpec, model: torch.nn.Module, device: str,
                sample_tokens: torch.Tensor | None = None) -> TrainStep:
    """Convert (torchao or minifloat, LM head left in bf16) and compile or graph `model` for
    the row (sample_tokens: a batch of the step's shape, for graph capture)."""
    recipe, conversion = None, None
    if spec.kind == "torchao-tensorwise":
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as error:
            raise RowSkipped(f"torchao is not importable ({error}); install the wheel in "
                             ".whl/ (BENCHMARKS.md) to time this row") from None
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(
            "tensorwise"), module_filter_fn=lambda module, fqn: not_head(fqn, module))
    if spec.kind not in ("bf16", "torchao-tensorwise"):
        import minifloat as mf

        kind = spec.kind.removesuffix(GRAPH_CASTS).removesuffix(MOE_OFFSETS)
        recipe = minifloat_recipe(kind.removesuffix(LOW_MEMORY))
        mf.convert_model(model, recipe=recipe, filter_fn=not_head)
        report = model.minifloat_conversion
        conversion = {"converted": len(report.converted),
                      "skipped": [list(entry) for entry in report.skipped]}
        if kind.endswith(LOW_MEMORY):
            mf.rebuild_weight_copies_in_backward(mf.save_original_inputs(model))
    loss_fn = model.loss
    if spec.graphed:
        loss_fn = graphed_loss(model, recipe, sample_tokens)
    elif spec.compiled:
        loss_fn = torch.compile(model.loss, mode=None if spec.compile_mode == "default"
                                else spec.compile_mode)
    step = TrainStep(model, loss_fn, make_optimizer(model, capturable=spec.step_graphed),
                     recipe=recipe,
                     graph_casts=True if spec.kind.endswith(GRAPH_CASTS) else None,
                     moe_offsets="always" if spec.kind.endswith(MOE_OFFSETS) else None,
                     mark_step=spec.compile_mode == "reduce-overhead",
                     host16=not (spec.compiled or spec.graphed or spec.step_graphed),
                     conversion=conversion)
    if spec.step_graphed:
        if not device.startswith("cuda"):
            raise RowSkipped("stepgraphed rows capture a CUDA graph and need a CUDA device")
        import minifloat as mf

        return mf.make_graphed_step(step)
    return step


class RowSkipped(Exception):
    """The row cannot run here (e.g. torchao missing): reported as skipped, not as failed."""


def make_batches(config: TorchGPTConfig | HFModelConfig, count: int, device: str, seed: int = SEED,
                 batch: int | None = None, seq: int | None = None) -> list[torch.Tensor]:
    """`count` batches of uniform random tokens [batch, seq+1] (never zeros: a constant input
    could take shortcuts no real batch does), the same for every row of a run."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (batch or config.batch_size, (seq or config.seq_len) + 1)
    return [torch.randint(0, config.vocab_size, shape, device=device, generator=generator)
            for _ in range(count)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _timed_steps(step: Callable, batches: list[torch.Tensor], device: str
                 ) -> tuple[list[float], torch.Tensor]:
    """Per-step ms of steps run back to back (CUDA events; perf_counter on the CPU)."""
    loss = None
    if device.startswith("cuda"):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in batches]
        torch.cuda.synchronize()
        for (start, end), tokens in zip(events, batches, strict=True):
            start.record()
            loss = step(tokens)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events], loss
    times = []
    for tokens in batches:
        start = time.perf_counter()
        loss = step(tokens)
        times.append((time.perf_counter() - start) * 1e3)
    return times, loss


def host_times(run: Callable[[torch.Tensor], object], batches: list[torch.Tensor], device: str,
               after: Callable[[], None] | None = None) -> list[float]:
    """Host ms of each call run(tokens): synchronize first, then perf_counter from the call to
    its return, no synchronization inside; `after` runs outside the timed window."""
    times = []
    for tokens in batches:
        _sync(device)
        start = time.perf_counter()
        run(tokens)
        times.append((time.perf_counter() - start) * 1e3)
        _sync(device)
        if after is not None:
            after()
    return times


def kernels_per_step(step: Callable, tokens: torch.Tensor) -> dict:
    """CUDA kernels (and, apart, memcpy/memset) in one step under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(tokens)
        torch.cuda.synchronize()
    device_events = [event for event in prof.events()
                     if event.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(event.name.startswith(("Memcpy", "Memset")) for event in device_events)
    return {"kernels_per_step": len(device_events) - copies, "memcpy_memset_per_step": copies}


def measure(step: TrainStep | Callable, batches: list[torch.Tensor], warmup: int, steps: int,
            device: str, host16_tokens: torch.Tensor | None = None) -> dict:
    """Every measurement of one row (see the module docstring); `step(tokens)` -> loss.

    batches: warmup + 2 * steps + 1 batches (warm-up, timed, host-timed, profiled)."""
    cuda = device.startswith("cuda")
    result: dict = {}
    _sync(device)
    start = time.perf_counter()
    first_loss = step(batches[0])
    result["first_loss"] = float(first_loss.item())
    result["first_step_s"] = time.perf_counter() - start
    for tokens in batches[1:warmup]:
        step(tokens)
    timed = batches[warmup:warmup + steps]
    ms, loss = _timed_steps(step, timed, device)
    result.update(ms_per_step=_median(ms), ms_steps=ms, final_loss=float(loss.item()))
    result["host_ms"] = _median(host_times(step, batches[warmup + steps:warmup + 2 * steps],
                                           device))
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if host16_tokens is not None and getattr(step, "host16", False):
        result.update(_host16(step, host16_tokens, device))
    if cuda:  # last: nothing is timed after the profiler has run
        result.update(kernels_per_step(step, batches[warmup + 2 * steps]))
    return result


def _host16(step: TrainStep, tokens: torch.Tensor, device: str) -> dict:
    """Host ms of forward+loss+backward on 16 tokens (gradients dropped after each), then of
    whole training steps on them (last: the optimizer steps leave the weights changed, so the
    profiled step after them starts as a step does, batched weight casts included)."""
    def drop() -> None:
        step.optimizer.zero_grad(set_to_none=True)

    try:
        host_times(step.forward_backward, [tokens] * 3, device, after=drop)  # warm-up
        values = host_times(step.forward_backward, [tokens] * HOST16_REPEATS, device, after=drop)
        steps = host_times(step, [tokens] * HOST16_REPEATS, device)
    except Exception as error:  # noqa: BLE001 - e.g. a recipe whose blocks need 128 rows
        drop()
        return {"host16_error": _error_text(error)}
    return {"host16_ms": _median(values), "host16_step_ms": _median(steps)}


def _error_text(error: BaseException) -> str:
    """One line (tables put it in a cell): the type and the start of the message."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:400]


def _free(device: str) -> None:
    """Drop the last row's compiled code, model and optimizer state before the next row."""
    torch._dynamo.reset()  # compiled code holds the model; also keeps the recompile limit away
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_row(name: str, build: Callable[[], TrainStep | Callable], batches: list[torch.Tensor],
            warmup: int, steps: int, device: str,
            host16_tokens: torch.Tensor | None = None) -> dict:
    """Build (peak memory statistics reset first), measure and free one row; a failure is
    recorded in the row ("error", or "skipped" for RowSkipped) instead of stopping the run."""
    row: dict = {"row": name}
    start = time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step = None
    try:
        step = build()
        if getattr(step, "conversion", None) is not None:
            row["conversion"] = step.conversion
        row.update(measure(step, batches, warmup, steps, device, host16_tokens))
    except RowSkipped as skipped:
        row["skipped"] = str(skipped)
    except Exception as error:  # noqa: BLE001 - recorded in the row, the run goes on
        row["error"] = _error_text(error)
        # the whole traceback, for whoever reads the JSON (the table shows the first line)
        row["traceback"] = "".join(traceback.format_exception(error))[-6000:]
        print(f"{name} failed:\n{row['traceback']}", file=sys.stderr)
        error.__traceback__ = None  # its frames hold the model: let _free release it
    step = None  # noqa: F841 - the last reference to the model and optimizer goes here
    _free(device)
    row["row_s"] = time.perf_counter() - start  # build, compile, every measurement, free
    return row


def add_ratios(rows: list[dict], baselines: dict[str, str]) -> None:
    """speedup_vs_<key> = baseline ms / row ms for each {key: baseline row name} of the same
    preset, and host16_cost_vs_bf16 = row host16 / bf16-eager host16 (a cost: <1.3 is the
    issue's target at 1b)."""
    for row in rows:
        same = {r["row"]: r for r in rows if r.get("preset") == row.get("preset")}
        for key, base_name in baselines.items():
            base = same.get(base_name, {}).get("ms_per_step")
            ms = row.get("ms_per_step")
            row[f"speedup_vs_{key}"] = base / ms if base and ms else None
        for key in ("host16", "host16_step"):
            base16 = same.get("bf16-eager", {}).get(f"{key}_ms")
            if f"{key}_ms" in row:
                row[f"{key}_cost_vs_bf16"] = row[f"{key}_ms"] / base16 if base16 else None


def environment(device: str) -> dict:
    """Device name and versions, recorded with every result file."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "torchao", "minifloat"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as None
            versions[name] = None
    try:
        # --dirty: the device machine runs a copy of the working tree on the session's first
        # commit, so a bare HEAD named a source the run did not have
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    cuda = device.startswith("cuda")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
            "device_type": "cuda" if cuda else "cpu", "versions": versions,
            "git_commit": commit or None}


def device_slug(env: dict) -> str:
    """'h100' from 'NVIDIA H100 80GB HBM3', else the name made file-safe ('cpu' on a CPU)."""
    if env["device_type"] == "cpu":
        return "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", env["device"])
    return (match.group(1) if match else re.sub(r"\W+", "_", env["device"])).lower()


def run_preset(preset: str, specs: list[RowSpec], steps: int, warmup: int, device: str,
               dtype: torch.dtype = torch.bfloat16,
               on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Every row of one preset, in order, in this process; on_row(row) after each."""
    config = PRESETS[preset]
    batches = make_batches(config, warmup + 2 * steps + 1, device)
    host16_tokens = make_batches(config, 1, device, seed=SEED + 1, batch=1,
                                 seq=HOST16_TOKENS)[0]
    rows = []
    for spec in specs:
        def build(spec: RowSpec = spec) -> TrainStep:
            return prepare_row(spec, build_model(config, device, dtype), device, batches[0])

        row = {"preset": preset, **run_row(spec.name, build, batches, warmup, steps, device,
                                           host16_tokens)}
        rows.append(row)
        print(tables.model_step_line(row), flush=True)
        unasked = [entry for entry in row.get("conversion", {}).get("skipped", [])
                   if "filter_fn" not in entry[2] and not entry[2].startswith("router")]
        if unasked:  # e.g. a MoE's experts left in bf16: the row does not measure the recipe
            print(f"  {spec.name}: {len(unasked)} layers not converted: "
                  + "; ".join(f"{name} ({reason})" for name, _, reason in unasked), flush=True)
        if on_row is not None:
            on_row(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b",
                        help=f"one or a comma list of: {', '.join(PRESETS)}")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help="comma list of rows; default: " + ", ".join(DEFAULT_ROWS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps (and host-timed)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1)")
    parser.add_argument("--compile-mode", choices=("default", "reduce-overhead", "both"),
                        default="default", help="torch.compile mode(s) of the compiled rows")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="parameter dtype; auto: bf16 on CUDA, fp32 on the CPU (CPU bf16 "
                             "matmuls without AMX run 5-10x slower than fp32: a smoke test "
                             "needs no bf16 there)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default benchmarks/results/model_step_<gpu>.json)")
    args = parser.parse_args(argv)
    presets = [name for name in args.preset.split(",") if name]
    try:
        unknown = [name for name in presets if name not in PRESETS]
        if unknown:
            raise ValueError(f"unknown preset(s) {unknown}; choose from {', '.join(PRESETS)}")
        if args.steps < 1 or args.warmup < 1:
            raise ValueError("--steps and --warmup must be >= 1")
        specs = expand_rows([name for name in args.rows.split(",") if name], args.compile_mode)
    except ValueError as error:
        parser.error(str(error))
    device = args.device
    notes = []
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("model_step: no CUDA device; skipped (use --device cpu for a CPU smoke run)",
              file=sys.stderr)
        return 0
    if not device.startswith("cuda"):
        notes.append("CPU run: kernels per step and peak memory need CUDA and are skipped; "
                     "host_ms equals the step's wall time here (no asynchronous device); "
                     "minifloat's quantized GEMMs are emulated, so times say nothing of GPUs")
    dtype = torch.float32 if args.dtype == "fp32" or (
        args.dtype == "auto" and not device.startswith("cuda")) else torch.bfloat16
    env = environment(device)
    print(f"model_step on {env['device']}, torch {env['versions']['torch']}, {dtype} "
          f"parameters, steps {args.steps}, warm-up {args.warmup}", flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    rows: list[dict] = []
    data = {"benchmark": "model_step", **env, "dtype": str(dtype).removeprefix("torch."),
            "steps": args.steps, "warmup": args.warmup,
            "compile_mode": args.compile_mode, "host16_tokens": HOST16_TOKENS,
            "configs": {name: {**asdict(PRESETS[name]),
                               "parameters": PRESETS[name].parameter_count()}
                        for name in presets},
            "notes": notes, "rows": rows}
    out = args.out or RESULTS / f"model_step_{device_slug(env)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(row: dict | None = None) -> None:
        """Rewritten after every row, so a run stopped at a time limit keeps its rows."""
        if row is not None:
            rows.append(row)
        add_ratios(rows, {"bf16_eager": "bf16-eager", "bf16_compiled": "bf16-compiled"})
        out.write_text(json.dumps(data, indent=2))

    for preset in presets:
        run_preset(preset, specs, args.steps, args.warmup, device, dtype, on_row=save)
    save()
    print()
    print(tables.model_step_table(data))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
