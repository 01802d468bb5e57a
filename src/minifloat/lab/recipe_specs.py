"""Recipe specs: the short text a user writes after `--recipes`, turned into Recipe objects.

A comparison is asked for on the command line, so every recipe needs a name that fits in a
comma-separated list. The grammar (also printed by `--recipes help`, see `recipes_help`):

    SPEC     := NAME [SUFFIX...] | hybrid:PARTS [SUFFIX...] | FACTORY | bf16-nudged
    NAME     := bf16 | fp8-delayed | fp8-current | fp8-block | mxfp8 | nvfp4
    PARTS    := FWD/BWD                  fprop=FWD, dgrad=wgrad=BWD
              | FPROP/DGRAD/WGRAD        one NAME per GEMM (bf16 = that GEMM in high precision)
    SUFFIX   := @lastN | @firstN         the last / first N transformer blocks in high precision
              | @hp=GLOB+GLOB...         HybridRecipe.high_precision patterns (layer-name globs,
                                         optionally GLOB:tensor_type)
              | @quantize-head           quantize the LM head too (the comparison keeps it in
                                         high precision by default)
    FACTORY  := module:function | path/to/file.py:function

A suffix turns the recipe into a HybridRecipe whose high_precision patterns keep the chosen
layers out of quantization; `mxfp8@last2` is HybridRecipe(mxfp8, mxfp8, mxfp8, ("blocks.0.*",
...)), which is bit for bit mxfp8 everywhere else. Block indices are resolved against the
model's n_layers, so `@last2` means blocks n-2 and n-1 of whichever preset runs.

A FACTORY names a user function, decided by its signature: a function taking no arguments
returns a Recipe (any recipe, HybridRecipe included); a function taking one argument is a
CustomRecipe quantizer factory, `fn(role: QuantizerRole) -> Quantizer`. Both are checked here,
with one probe call, so a broken factory fails before any training starts.

"bf16" is the high-precision baseline: autocast disabled, no quantization (bf16 parameters on
a GPU, fp32 on the CPU, where the comparison runs in fp32). "bf16-nudged" is the same baseline
with its initial weights moved by one bf16 step (lab.noise_control): a control whose gap to
bf16 measures how far chaos alone moves a same-seed run.

The LM head: `parse_recipe(..., head_in_high_precision=True)` (what `compare` asks for) keeps
the layer named "head" in high precision in every named or hybrid spec, as Megatron-LM and
torchtitan do by default: quantizing it decided the FP8 result of the lab's comparisons
(issue 19), and it is a small share of the FLOPs. `@quantize-head` opts back in.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from ..quantizers import Quantizer
from ..recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    HybridRecipe,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerRole,
    Recipe,
)
from .noise_control import CONTROL

BASELINE = "bf16"

# name -> (constructor, one-line description); bf16 builds None (no quantization).
NAMED_RECIPES: dict[str, tuple[Callable[[], Recipe | None], str]] = {
    BASELINE: (lambda: None, "no quantization: the high-precision baseline"),
    "fp8-delayed": (DelayedScaling,
                    "FP8 per-tensor, scales from an amax history (E4M3 fwd, E5M2 grads)"),
    "fp8-current": (Float8CurrentScaling,
                    "FP8 per-tensor, scale from each tensor's own amax (E4M3 fwd, E5M2 grads)"),
    "fp8-block": (Float8BlockScaling,
                  "FP8 E4M3 in 1x128 blocks, weights in 128x128 tiles (DeepSeek style)"),
    "mxfp8": (MXFP8BlockScaling, "MXFP8: E4M3 elements, one E8M0 scale per 32"),
    "nvfp4": (NVFP4BlockScaling,
              "NVFP4: E2M1 elements, UE4M3 scale per 16 + fp32; 16x16 weights, RHT, SR grads"),
}

HYBRID_PREFIX = "hybrid:"
HEAD_LAYER = "head"
QUANTIZE_HEAD = "quantize-head"
_BLOCK_SUFFIX = re.compile(r"(first|last)(\d+)")


def _valid_hint() -> str:
    return (f"valid names: {', '.join(NAMED_RECIPES)}; also {CONTROL}, hybrid:FWD/BWD, "
            "hybrid:FPROP/DGRAD/WGRAD, NAME@last2, NAME@hp=GLOB+GLOB, module:function, "
            "path/file.py:function (see --recipes help)")


def _named(name: str, token: str) -> Recipe | None:
    if name not in NAMED_RECIPES:
        where = "" if name == token else f" in {token!r}"
        raise ValueError(f"unknown recipe {name!r}{where}; {_valid_hint()}")
    return NAMED_RECIPES[name][0]()


def _high_precision_patterns(suffixes: list[str], token: str, n_layers: int) -> tuple[str, ...]:
    """The HybridRecipe.high_precision globs that the @-suffixes of one spec ask for."""
    patterns: list[str] = []
    for suffix in suffixes:
        block = _BLOCK_SUFFIX.fullmatch(suffix)
        if block:
            count = int(block.group(2))
            if not 1 <= count <= n_layers:
                raise ValueError(f"{token!r}: @{suffix} asks for {count} blocks, but the model "
                                 f"has {n_layers} (blocks.0 .. blocks.{n_layers - 1})")
            first = 0 if block.group(1) == "first" else n_layers - count
            patterns += [f"blocks.{i}.*" for i in range(first, first + count)]
        elif suffix.startswith("hp="):
            globs = [glob for glob in suffix[3:].split("+") if glob]
            if not globs:
                raise ValueError(f"{token!r}: @hp= needs at least one layer glob, e.g. "
                                 "@hp=head+blocks.0.*")
            patterns += globs
        else:
            raise ValueError(f"{token!r}: unknown suffix @{suffix}; use @lastN, @firstN or "
                             "@hp=GLOB+GLOB (see --recipes help)")
    return tuple(dict.fromkeys(patterns))  # keep order, drop repeats


def _hybrid(body: str, token: str) -> HybridRecipe:
    parts = body.split("/")
    if len(parts) == 2:
        parts = [parts[0], parts[1], parts[1]]
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{token!r}: a hybrid is hybrid:FWD/BWD or hybrid:FPROP/DGRAD/WGRAD, "
                         f"each part one of {', '.join(NAMED_RECIPES)}")
    fprop, dgrad, wgrad = (_named(part, token) for part in parts)
    return HybridRecipe(fprop=fprop, dgrad=dgrad, wgrad=wgrad)


def _load_function(target: str, token: str) -> Callable:
    """`module:function` or `path/to/file.py:function` -> the function object."""
    location, _, function_name = target.rpartition(":")
    if not location or not function_name:
        raise ValueError(f"{token!r}: a factory is module:function or path/file.py:function")
    if location.endswith(".py") or "/" in location or "\\" in location:
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{token!r}: no such file {location}")
        # A stable, unique module name per file, registered so the recipe can be pickled.
        module_name = "minifloat_user_recipe_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{token!r}: cannot load {location} as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            sys.modules.pop(module_name, None)
            raise ValueError(f"{token!r}: importing {location} failed: "
                             f"{type(error).__name__}: {error}") from error
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise ValueError(f"{token!r}: cannot import module {location!r} ({error}); is it "
                             "on PYTHONPATH? A file can be given as path/to/file.py:function"
                             ) from error
        except Exception as error:
            raise ValueError(f"{token!r}: importing {location} failed: "
                             f"{type(error).__name__}: {error}") from error
    function = getattr(module, function_name, None)
    if function is None or not callable(function):
        raise ValueError(f"{token!r}: {location} has no function {function_name!r}")
    return function


def _required_arguments(function: Callable) -> int:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return 1  # builtins and the like: treat as a quantizer factory
    return sum(1 for p in signature.parameters.values()
               if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _factory_recipe(target: str, token: str) -> Recipe:
    """A user function as a Recipe: called for one (no arguments) or probed once (one)."""
    function = _load_function(target, token)
    required = _required_arguments(function)
    if required == 0:
        try:
            recipe = function()
        except Exception as error:
            raise ValueError(f"{token!r}: the recipe function raised "
                             f"{type(error).__name__}: {error}") from error
        if not isinstance(recipe, Recipe):
            raise ValueError(f"{token!r}: a function without arguments must return a minifloat "
                             f"Recipe, got {type(recipe).__name__}")
        return recipe
    if required == 1:
        probe = QuantizerRole("linear", "input", "blocks.0.attn.qkv")
        try:
            quantizer = function(probe)
        except Exception as error:
            raise ValueError(f"{token!r}: the quantizer factory raised on {probe}: "
                             f"{type(error).__name__}: {error}") from error
        if not isinstance(quantizer, Quantizer):
            raise ValueError(f"{token!r}: a factory fn(role) must return a minifloat Quantizer "
                             f"(IdentityQuantizer for high precision), got "
                             f"{type(quantizer).__name__}")
        return CustomRecipe(function)
    raise ValueError(f"{token!r}: the function takes {required} arguments; write fn() -> Recipe "
                     "or fn(role) -> Quantizer")


def parse_recipe(token: str, n_layers: int, head_in_high_precision: bool = False
                 ) -> Recipe | None:
    """One spec (no commas) -> its Recipe, or None for the bf16 baseline.

    head_in_high_precision: a named or hybrid spec keeps the "head" layer in high precision
    unless it carries @quantize-head (a user's factory decides for itself)."""
    token = token.strip()
    if not token:
        raise ValueError(f"empty recipe name; {_valid_hint()}")
    if token == CONTROL:  # the bf16 run with nudged initial weights (lab.noise_control)
        return None
    body, *suffixes = token.split("@")
    if body == CONTROL:
        raise ValueError(f"{token!r}: {CONTROL} is the bf16 control and takes no @ suffix")
    quantize_head = QUANTIZE_HEAD in suffixes
    suffixes = [suffix for suffix in suffixes if suffix != QUANTIZE_HEAD]
    if head_in_high_precision and not quantize_head and ":" not in body.removeprefix(
            HYBRID_PREFIX) and body != BASELINE:
        suffixes.append(f"hp={HEAD_LAYER}")
    if body.startswith(HYBRID_PREFIX) or ":" not in body:
        if body.startswith(HYBRID_PREFIX):
            recipe: Recipe | None = _hybrid(body[len(HYBRID_PREFIX):], token)
        else:
            recipe = _named(body, token)
        if not suffixes:
            return recipe
        if recipe is None:
            raise ValueError(f"{token!r}: bf16 is already all high precision; a @ suffix "
                             "goes on a quantized recipe, e.g. mxfp8@last2")
        patterns = _high_precision_patterns(suffixes, token, n_layers)
        gemms = ((recipe.fprop, recipe.dgrad, recipe.wgrad) if isinstance(recipe, HybridRecipe)
                 else (recipe, recipe, recipe))
        try:
            return HybridRecipe(*gemms, high_precision=patterns)
        except ValueError as error:
            raise ValueError(f"{token!r}: {error}") from error
    return _factory_recipe(token, token)


def parse_recipes(text: str, n_layers: int, head_in_high_precision: bool = False
                  ) -> list[tuple[str, Recipe | None]]:
    """"bf16,mxfp8,hybrid:mxfp8/nvfp4@last2" -> [(label, Recipe or None), ...].

    The label is the spec as written. Raises ValueError naming the bad spec (and listing the
    valid names) for anything that does not parse, and for a spec listed twice.
    """
    tokens = [token.strip() for token in text.split(",")]
    if not any(tokens):
        raise ValueError(f"--recipes is empty; {_valid_hint()}")
    result: list[tuple[str, Recipe | None]] = []
    for token in tokens:
        if any(label == token for label, _ in result):
            raise ValueError(f"recipe {token!r} is listed twice")
        result.append((token, parse_recipe(token, n_layers, head_in_high_precision)))
    return result


def recipes_help() -> str:
    """The text `--recipes help` prints: names, spec syntax, examples."""
    width = max(len(name) for name in NAMED_RECIPES)
    lines = ["Recipes for --recipes (comma-separated):", ""]
    lines += [f"  {name:<{width}}  {description}"
              for name, (_, description) in NAMED_RECIPES.items()]
    lines += [
        "",
        "A control (a measured noise floor for same-seed gaps):",
        f"  {CONTROL}                 bf16 with each initial weight moved to an adjacent bf16",
        "                              value: its gap to bf16 is what chaos alone does",
        "",
        "Hybrids (one recipe per GEMM; bf16 = that GEMM in high precision):",
        "  hybrid:FWD/BWD              fprop=FWD, dgrad=wgrad=BWD   e.g. hybrid:mxfp8/nvfp4",
        "  hybrid:FPROP/DGRAD/WGRAD    e.g. hybrid:fp8-block/nvfp4/bf16",
        "",
        "Suffixes (any quantized recipe; they combine: mxfp8@first1@last1):",
        "  @lastN / @firstN            the last / first N transformer blocks in high precision",
        "  @quantize-head              quantize the LM head too (compare keeps it in high",
        "                              precision by default, as large frameworks do)",
        "  @hp=GLOB+GLOB               layer globs kept in high precision; layer names are",
        "                              blocks.{i}.attn.qkv, blocks.{i}.attn.proj,",
        "                              blocks.{i}.mlp.fc1, blocks.{i}.mlp.fc2 and head;",
        "                              GLOB:input|weight|grad_output picks one operand",
        "",
        "Your own recipe (the file or module is imported; checked before training):",
        "  module:function             importable module (e.g. from the current directory)",
        "  path/to/file.py:function    a Python file",
        "    function()      -> Recipe     any minifloat Recipe, HybridRecipe included",
        "    function(role)  -> Quantizer  wrapped in CustomRecipe; role is a QuantizerRole",
        "",
        "Example (MXFP8 forward, NVFP4 backward, last two blocks in high precision):",
        "  python -m minifloat compare --recipes bf16,mxfp8,hybrid:mxfp8/nvfp4@last2",
    ]
    return "\n".join(lines)
