"""Train one model per recipe from the same start and measure what each recipe changes.

The question a recipe comparison answers is "does this recipe train like the high-precision
baseline, and what does it cost?", so everything except the recipe is held fixed: the same
GPTConfig, the same initial weights (torch.manual_seed(seed) before each build), the same batch
sequence (a torch.Generator seeded with seed), the same validation batches (seeded with
seed + 1), the same optimizer and schedule, and the same global RNG state for NVFP4's
stochastic rounding. Two runs with one seed therefore give bitwise equal losses on one machine.

Everything a user can get wrong (step count, preset, device, recipe specs, the output folder,
the data) is checked in `prepare_comparison` before the first step, so a typo costs seconds,
not a wasted run. Failures raise ComparisonError; the CLI prints them as `error: ...`.

On CUDA the parameters are bf16 and the quantized GEMMs take minifloat's fast paths wherever a
kernel exists (the library dispatches by device); the bf16 baseline runs the same bf16 model
with minifloat's autocast disabled. On the CPU the parameters are fp32 and every quantized GEMM
runs by exact emulation, so CPU tokens/s measure emulation cost, not what a GPU would do.
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..autocast import autocast
from ..models.gpt import GPT, PRESETS, GPTConfig
from ..recipes import Recipe
from . import resume
from .data import Corpus, load_corpus, sample_batch
from .noise_control import CONTROL, nudge_weights
from .recipe_specs import parse_recipes

DEMO_RECIPES = "bf16,fp8-current,mxfp8,nvfp4,hybrid:mxfp8/nvfp4"
DEFAULT_LR = 3e-3
# The peak learning rate of each preset when --lr is not given (issue 19): tiny from the
# recorded bf16 sweep (benchmarks/lr_sweep.py, BENCHMARKS.md 2026-11-26: 3e-3 best, 1e-3 within
# its noise); small from issue 19's H200 runs (at 3e-3 the bf16 baseline stalled near val loss
# 2.3 from step 200 on, at 1e-3 it reached 1.09 in 1200 steps); 1b as small until its sweep runs
# on a GPU (larger models take smaller rates, and 3e-3 already stalls at small).
PRESET_LR = {"tiny": 3e-3, "small": 1e-3, "1b": 1e-3}
DEFAULT_VAL_BATCHES = 8
AUTO_EVALUATIONS = 4
GRAD_CLIP = 1.0
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


class ComparisonError(ValueError):
    """A bad argument, found before any training started."""


@dataclass
class Plan:
    """A validated comparison: what `run_comparison` trains, and with what."""

    recipes: list[tuple[str, Recipe | None]]
    steps: int
    preset: str
    model: GPTConfig
    out_dir: Path
    seed: int
    lr: float
    device: torch.device
    eval_every: int | None  # None: AUTO_EVALUATIONS evenly spaced; 0: only after the last step
    val_batches: int
    corpus: Corpus
    deterministic: bool = False  # torch's deterministic algorithms for the whole comparison
    resume: bool = True  # checkpoint each run after every evaluation; resume from the last

    def eval_steps(self) -> list[int]:
        """The steps after which the validation batches are evaluated (always the last)."""
        if self.eval_every is None:
            count = min(AUTO_EVALUATIONS, self.steps)
            steps = {math.ceil(self.steps * k / count) for k in range(1, count + 1)}
        else:
            steps = set(range(self.eval_every, self.steps + 1, self.eval_every)) \
                if self.eval_every else set()
        return sorted(steps | {self.steps})

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def describe(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (for results.json)."""
        return {
            "preset": self.preset,
            "model": {**vars(self.model), "parameters": self.model.parameter_count()},
            "tokens_per_step": self.model.tokens_per_step,
            "steps": self.steps,
            "seed": self.seed,
            "lr": self.lr,
            "schedule": "linear warm-up over the first 10% of steps, cosine to 10% of lr",
            "optimizer": f"AdamW(betas={BETAS}, weight_decay={WEIGHT_DECAY}), "
                         f"grad-norm clip {GRAD_CLIP}",
            "eval_steps": self.eval_steps(),
            "val_batches": self.val_batches,
            "deterministic": self.deterministic,
            "device": _device_name(self.device),
            "params_dtype": str(self.params_dtype).removeprefix("torch."),
            "data": self.corpus.source,
            "recipes": {label: repr(recipe) for label, recipe in self.recipes},
            # the layer globs each recipe keeps out of quantization (the head by default)
            "high_precision": {label: list(getattr(recipe, "high_precision", ()))
                               for label, recipe in self.recipes},
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_threads": torch.get_num_threads(),
        }


@dataclass
class RunResult:
    """One recipe's curves and costs."""

    label: str
    train_loss: list[float]
    val_loss: list[tuple[int, float]]  # (step, mean loss over the validation batches)
    tokens_per_second: float
    peak_memory_mib: float
    memory_kind: str
    seconds: float
    diverged_at: int | None = None

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1][1] if self.val_loss else math.nan

    @property
    def final_train_loss(self) -> float:
        """Mean of the last 10% of the steps (at least one): one step's loss is too noisy."""
        if not self.train_loss:
            return math.nan
        tail = max(1, len(self.train_loss) // 10)
        return sum(self.train_loss[-tail:]) / tail


@dataclass
class Comparison:
    plan: Plan
    runs: list[RunResult] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # --deterministic: bf16 step time with deterministic algorithms over without (measured)
    deterministic_cost: float | None = None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ComparisonError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ComparisonError("--device cuda: torch sees no CUDA device here; use --device cpu")
    return torch.device(device)


def _check_out_dir(out_dir: str | Path) -> Path:
    """Create the folder and write a probe file, so an unwritable --out fails now."""
    path = Path(out_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ComparisonError(f"--out {out_dir}: exists and is not a folder")
    probe = path / ".minifloat-write-probe"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe\n")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ComparisonError(f"--out {out_dir}: cannot write there ({reason})") from error
    return path


def _check_integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ComparisonError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def prepare_comparison(recipes: str | Iterable[tuple[str, Recipe | None]], steps: int,
                       preset: str | GPTConfig = "tiny", out_dir: str | Path = "compare-out",
                       seed: int = 0, data_path: str | Path | None = None,
                       device: str = "auto", lr: float | None = None,
                       eval_every: int | None = None,
                       val_batches: int = DEFAULT_VAL_BATCHES,
                       deterministic: bool = False) -> Plan:
    """Check every argument and load the data; raises ComparisonError before any training.

    eval_every=None evaluates AUTO_EVALUATIONS times, evenly spaced, the last after the last
    step; 0 only after the last step. `preset` is a PRESETS name or a GPTConfig.
    """
    steps = _check_integer("--steps", steps, 1)
    seed = _check_integer("--seed", seed, 0)
    val_batches = _check_integer("--val-batches", val_batches, 1)
    if eval_every is not None:
        eval_every = _check_integer("--eval-every", eval_every, 0)
    if lr is None:  # the preset's own (a custom GPTConfig takes DEFAULT_LR)
        lr = PRESET_LR.get(preset if isinstance(preset, str) else "", DEFAULT_LR)
    if not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0:
        raise ComparisonError(f"--lr must be a positive number, got {lr!r}")
    if isinstance(preset, GPTConfig):
        preset_name, model = "custom", preset
    elif preset in PRESETS:
        preset_name, model = preset, PRESETS[preset]
    else:
        raise ComparisonError(f"unknown preset {preset!r}; choose one of "
                              f"{', '.join(PRESETS)}")
    resolved_device = _resolve_device(device)
    if isinstance(recipes, str):
        try:
            parsed = parse_recipes(recipes, model.n_layers, head_in_high_precision=True)
        except ValueError as error:
            raise ComparisonError(str(error)) from error
    else:
        parsed = list(recipes)
        if not parsed:
            raise ComparisonError("no recipes to compare")
    path = _check_out_dir(out_dir)
    try:
        corpus = load_corpus(data_path)
    except (OSError, ValueError) as error:
        raise ComparisonError(str(error)) from error
    window = model.seq_len + 1
    if corpus.validation.numel() <= window or corpus.train.numel() <= window:
        raise ComparisonError(f"the data at {corpus.source} is too small for the model's "
                              f"sequence length: each split needs more than {window} bytes")
    return Plan(parsed, steps, preset_name, model, path, seed, float(lr), resolved_device,
                eval_every, val_batches, corpus, bool(deterministic))


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine down to 10% of the peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class _PeakMemory:
    """Peak memory of one run: CUDA's allocator peak, or on the CPU the process's peak RSS.

    On Linux the RSS peak (VmHWM) is reset before each run through /proc/self/clear_refs, so it
    is that run's peak; elsewhere getrusage's ru_maxrss is the peak of the whole process so far.
    Either CPU figure includes the interpreter, torch and the corpus: approximate.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda max_memory_allocated"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            return
        self.kind = "process peak RSS (approximate)"
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.kind = "process peak RSS of this run (approximate)"
        except OSError:
            pass

    def mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            with open("/proc/self/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def evaluate(model: GPT, batches: list[torch.Tensor], recipe: Recipe | None) -> float:
    """Mean loss over `batches` with the forward under `recipe` (None: high precision)."""
    with torch.no_grad(), autocast(enabled=recipe is not None, recipe=recipe):
        losses = [model.loss(batch).item() for batch in batches]
    return sum(losses) / len(losses)


def _batches(plan: Plan, data: torch.Tensor, generator: torch.Generator
             ) -> Iterator[torch.Tensor]:
    while True:
        batch = sample_batch(data, plan.model.batch_size, plan.model.seq_len, generator)
        yield batch.to(plan.device, non_blocking=True)


def validation_batches(plan: Plan) -> list[torch.Tensor]:
    """The fixed validation batches of every run of a plan (drawn from seed + 1)."""
    return list(itertools.islice(
        _batches(plan, plan.corpus.validation, torch.Generator().manual_seed(plan.seed + 1)),
        plan.val_batches))


def _fingerprint(plan: Plan, label: str, recipe: Recipe | None) -> str:
    """What a checkpoint must have been made under to be resumed (resume.py)."""
    settings = {key: value for key, value in plan.describe().items()
                if key not in ("torch", "python", "platform", "cpu_threads", "recipes",
                               "high_precision", "deterministic")}
    return repr((label, repr(recipe), sorted(settings.items())))


def train_recipe(plan: Plan, label: str, recipe: Recipe | None,
                 on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Train plan.steps steps of a fresh model under one recipe; see the module docstring."""
    device = plan.device
    gc.collect()
    memory = _PeakMemory(device)
    torch.manual_seed(plan.seed)
    model = GPT(plan.model, dtype=plan.params_dtype, device=device)
    if label == CONTROL:  # the bf16 run whose gap measures chaos alone (lab.noise_control)
        nudge_weights(model, plan.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=BETAS,
                                  weight_decay=WEIGHT_DECAY)
    val_batches = validation_batches(plan)
    generator = torch.Generator().manual_seed(plan.seed)
    train_batches = _batches(plan, plan.corpus.train, generator)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    eval_steps = set(plan.eval_steps())
    train_loss: list[float] = []
    val_loss: list[tuple[int, float]] = []
    timed_seconds, timed_steps, diverged_at = 0.0, 0, None
    first_step = 0
    path = resume.checkpoint_path(plan.out_dir, label)
    fingerprint = _fingerprint(plan, label, recipe)
    saved = resume.load(path, fingerprint, label) if plan.resume else None
    if saved is not None:  # pick the run up where its last checkpoint left it
        print(f"{label}: resuming from {path} at step {saved['step']} of {plan.steps} (delete "
              "the folder's checkpoints/ to train afresh)", file=sys.stderr, flush=True)
        resume.restore(saved, model, optimizer, generator, recipe)
        first_step, train_loss = saved["step"], list(saved["train_loss"])
        val_loss = [(int(step), float(value)) for step, value in saved["val_loss"]]
        timed_seconds, timed_steps = saved["timed_seconds"], saved["timed_steps"]
        train_batches = _batches(plan, plan.corpus.train, generator)
    started = time.perf_counter()
    for step in range(first_step, plan.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, plan.steps, plan.lr)
        batch = next(train_batches)
        sync()
        tic = time.perf_counter()
        with autocast(enabled=recipe is not None, recipe=recipe):
            loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # synchronizes
        sync()
        if step > 0 or plan.steps == 1:  # the first step is warm-up (allocations, caches)
            timed_seconds += time.perf_counter() - tic
            timed_steps += 1
        train_loss.append(value)
        if on_step is not None:
            on_step(step + 1, value)
        if not math.isfinite(value):
            diverged_at = step + 1
            break
        if step + 1 in eval_steps:
            val_loss.append((step + 1, evaluate(model, val_batches, recipe)))
            if plan.resume:
                resume.save(path, fingerprint, step + 1, model, optimizer, generator, recipe,
                            {"train_loss": train_loss, "val_loss": [list(v) for v in val_loss],
                             "timed_seconds": timed_seconds, "timed_steps": timed_steps})
    if diverged_at is not None:
        val_loss.append((diverged_at, math.nan))
    tokens = plan.model.tokens_per_step * timed_steps
    result = RunResult(label, train_loss, val_loss,
                       tokens / timed_seconds if timed_seconds > 0 else math.nan,
                       memory.mib(), memory.kind, time.perf_counter() - started, diverged_at)
    del model, optimizer
    return result


class _Progress:
    """A tqdm bar per recipe when tqdm is installed, else a line on stderr every ~10%."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.bar = label, total, None
        self.enabled = enabled
        self.started = time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            print(f"{label}: {total} steps", file=sys.stderr, flush=True)
            return
        self.bar = tqdm(total=total, desc=label, unit="step", file=sys.stderr,
                        dynamic_ncols=True, leave=True)

    def __call__(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            return
        every = max(1, self.total // 10)
        if step % every == 0 or step == self.total:
            rate = (time.perf_counter() - self.started) / step
            print(f"  {self.label}: step {step}/{self.total}  loss {loss:.3f}  "
                  f"({rate:.2f} s/step)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_plan(plan: Plan, progress: bool = True) -> Comparison:
    """Train every recipe of a validated plan, then write the reports into plan.out_dir."""
    from .report import write_reports

    comparison = Comparison(plan)
    if plan.deterministic:
        comparison.deterministic_cost = deterministic_cost(plan)
    with deterministic_algorithms(True) if plan.deterministic else nullcontext():
        for index, (label, recipe) in enumerate(plan.recipes, start=1):
            bar = _Progress(f"[{index}/{len(plan.recipes)}] {label}", plan.steps, progress)
            try:
                comparison.runs.append(train_recipe(plan, label, recipe, on_step=bar))
            finally:
                bar.close()
            write_reports(comparison, plot=False)  # a partial record if a later one stops
    write_reports(comparison)
    return comparison


COST_STEPS = 6


@contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """torch's deterministic algorithms on or off (warning, not failing, where an op has none)
    for the block, the previous setting restored after it."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def request_deterministic_cublas() -> None:
    """cuBLAS's deterministic workspace, which it reads when its first handle is made: call
    before any CUDA work (spawned workers inherit it). A value the user set is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def deterministic_cost(plan: Plan) -> float:
    """What --deterministic costs: the bf16 model's step time over COST_STEPS steps (the
    first untimed) with torch's deterministic algorithms, over the same without. Why measured
    here: the cost depends on the device and the kernels each recipe reaches, so a constant
    would mislead. On CUDA, cuBLAS also needs request_deterministic_cublas() (the CLI calls it)."""
    probe = replace(plan, steps=COST_STEPS, eval_every=0, val_batches=1, resume=False)
    times = []
    for enabled in (False, True):
        with deterministic_algorithms(enabled):
            run = train_recipe(probe, "cost probe", None)
        times.append(1.0 / run.tokens_per_second)
    return times[1] / times[0]


def run_comparison(recipes: str | Iterable[tuple[str, Recipe | None]], steps: int,
                   preset: str | GPTConfig = "tiny", out_dir: str | Path = "compare-out",
                   seed: int = 0, data_path: str | Path | None = None, device: str = "auto",
                   lr: float | None = None, eval_every: int | None = None,
                   progress: bool = True,
                   val_batches: int = DEFAULT_VAL_BATCHES,
                   deterministic: bool = False) -> Comparison:
    """Validate everything (ComparisonError before any training), train each recipe from the
    same seed, and write table.txt, results.json, results.csv, curves.csv and loss_curves.png
    into out_dir."""
    plan = prepare_comparison(recipes, steps, preset, out_dir, seed, data_path, device, lr,
                              eval_every, val_batches, deterministic)
    return run_plan(plan, progress)
