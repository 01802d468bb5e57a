"""The rows of the model benchmarks (model_step, memory_probe, gpt_step, scale_step): what a row
name says, taken apart.

Why a module of its own: the row vocabulary (kinds, modes, the default rows) is shared by every
end-to-end benchmark, and model_step's measuring code is long enough without it. The names are
documented in model_step's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

RECIPE_NAMES = ("fp8-current", "fp8-delayed", "fp8-block", "mxfp8", "nvfp4")
LOW_MEMORY = "-lowmem"
GRAPH_CASTS = "-graphcasts"
MOE_OFFSETS = "-offsets"  # a MoE's experts on the device-offsets path eagerly too
KINDS = ("bf16", "torchao-tensorwise", *RECIPE_NAMES,
         *(name + LOW_MEMORY for name in RECIPE_NAMES),
         *(name + GRAPH_CASTS for name in ("fp8-current", "fp8-current" + LOW_MEMORY)),
         "fp8-current" + MOE_OFFSETS)
# each recipe eager, eager with CUDA graphs, and compiled with CUDA graphs (default-mode compiled
# rows are host-bound, BENCHMARKS.md 2026-11-25: ask for them by name), and FP8 current's whole
# step as one graph
DEFAULT_ROWS = ["bf16-eager", "bf16-graphed", "bf16-compiled", "torchao-tensorwise-compiled"] + [
    f"{name}-{mode}" for name in RECIPE_NAMES
    for mode in ("eager", "graphed", "compiled-reduce-overhead")] + [
    "fp8-current-stepgraphed"]  # the whole step, optimizer included (make_graphed_step)
REDUCE_OVERHEAD = "-reduce-overhead"
GRAPHED = "-graphed"
STEP_GRAPHED = "-stepgraphed"


def minifloat_recipe(name: str):
    """The minifloat recipe of a row kind (fp8-current, ...), default arguments."""
    import minifloat as mf

    return {"fp8-current": mf.Float8CurrentScaling, "fp8-delayed": mf.DelayedScaling,
            "fp8-block": mf.Float8BlockScaling, "mxfp8": mf.MXFP8BlockScaling,
            "nvfp4": mf.NVFP4BlockScaling}[name]()


@dataclass(frozen=True)
class RowSpec:
    """A row name taken apart: kind (bf16, torchao-tensorwise or a recipe), compiled, mode."""

    name: str
    kind: str
    compiled: bool
    compile_mode: str | None = None  # "default" or "reduce-overhead" when compiled
    graphed: bool = False  # eager, captured as CUDA graphs
    step_graphed: bool = False  # the whole step captured as one CUDA graph

    @classmethod
    def parse(cls, name: str) -> RowSpec:
        if name.endswith(STEP_GRAPHED):
            rest = name.removesuffix(STEP_GRAPHED)
            if rest.endswith((REDUCE_OVERHEAD, GRAPHED)):
                raise ValueError(f"row {name!r}: the whole step is captured; its parts are "
                                 "not graphed again (use <kind>[-compiled]-stepgraphed)")
            inner = cls.parse(rest if rest.endswith("-compiled") else rest + "-eager")
            return replace(inner, name=name, step_graphed=True)
        rest, mode = name, None
        if rest.endswith(GRAPHED):
            kind = rest.removesuffix(GRAPHED)
            if kind not in KINDS:
                raise ValueError(f"row {name!r}: unknown kind {kind!r}; kinds: "
                                 f"{', '.join(KINDS)}")
            return cls(name, kind, compiled=False, graphed=True)
        if rest.endswith(REDUCE_OVERHEAD):
            rest, mode = rest.removesuffix(REDUCE_OVERHEAD), "reduce-overhead"
        if rest.endswith("-compiled"):
            kind, compiled, mode = rest.removesuffix("-compiled"), True, mode or "default"
        elif rest.endswith("-eager") and mode is None:
            kind, compiled = rest.removesuffix("-eager"), False
        else:
            raise ValueError(f"row {name!r} must end in -eager, -compiled, "
                             f"-compiled{REDUCE_OVERHEAD} or {GRAPHED}")
        if kind not in KINDS:
            raise ValueError(f"row {name!r}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        return cls(name, kind, compiled, mode)


def expand_rows(names: list[str], compile_mode: str) -> list[RowSpec]:
    """Row specs for --rows and --compile-mode (reduce-overhead replaces, both adds)."""
    specs = []
    for name in names:
        spec = RowSpec.parse(name)
        if spec.compiled and spec.compile_mode == "default" and compile_mode != "default":
            if compile_mode == "both":
                specs.append(spec)
            specs.append(RowSpec.parse(name + REDUCE_OVERHEAD))
        else:
            specs.append(spec)
    return specs
