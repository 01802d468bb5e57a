"""convert_model: swap a model's GEMM layers for minifloat.Linear in place, keeping their
weights, and say what it did.

Converted: nn.Linear, the GPT-2 family's `Conv1D` (transformers.pytorch_utils.Conv1D: a
Linear whose weight is stored [in, out]), and transformers' fused mixture-of-experts weights
(Mixtral, Qwen-MoE: 3-D gate_up_proj / down_proj) onto grouped GEMMs (modules/fused_experts.py).
A Conv1D's weight is transposed once, here, into
the [out, in] layout the GEMMs read, so no step copies it; state-dict hooks keep its saved
layout and key, so `save_pretrained` / `from_pretrained` and plain-model checkpoints still
match.

Not converted, each with its reason in the report: layers `filter_fn` refuses, mixture-of-experts
routers (kept in high precision, as Megatron-LM and torchtitan keep them), layers whose
feature dimensions the recipe's formats cannot hold (e.g. 100 features under MXFP8's blocks of
32), and modules of an unknown type that hold matrix weights (e.g. a mixture of experts' fused
3-D expert weights run with grouped matmuls), which would silently stay in high precision.
`strict=True` makes the last two an error.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .modules import Linear, QuantizedModule
from .modules.fused_experts import FusedExperts, computes_like, fused_experts_layout
from .recipe_state import RecipeState
from .recipes import Recipe

LOGGER = logging.getLogger("minifloat")
_FILTERED = "refused by filter_fn"
# a mixture of experts' router stays in high precision (its top-k choice is sensitive to it)
_ROUTER = "router: kept in high precision"

# modules with matrix parameters that are no GEMM a recipe quantizes
_NOT_GEMMS = (nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd, nn.LayerNorm, nn.RMSNorm,
              nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.MultiheadAttention)


@dataclass
class ConversionReport:
    """What convert_model did: converted layers (name, kind, weight shape) and skipped ones
    (name, module type, reason). `model.minifloat_conversion` keeps the last one."""

    converted: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"convert_model: {len(self.converted)} layers converted, "
                 f"{len(self.skipped)} skipped"]
        lines += [f"  converted {name} ({kind} {list(shape)})"
                  for name, kind, shape in self.converted]
        lines += [f"  skipped   {name} ({kind}): {reason}" for name, kind, reason in self.skipped]
        return "\n".join(lines)


def _fits_recipe(shape: tuple[int, int], recipe: Recipe | None, name: str) -> bool:
    """Whether every quantizer of the recipe can hold a weight [N, K]."""
    if recipe is None:
        return True
    probe = Linear(1, 1, bias=False, device="meta", name=name)
    forward = RecipeState.create(recipe, "forward", 3, probe.get_quantizer_roles(True))
    weight_quantizer = forward.make_quantizers()[1]
    return weight_quantizer.is_quantizable(torch.empty(shape, device="meta"))


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2, GPT-J's ancestors): weight [in, out], y = x W + b."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and getattr(module, "weight", None) is not None and module.weight.dim() == 2)


def _unknown_gemm(module: nn.Module) -> bool:
    """A leaf-level module of another type holding matrix (or stacked-matrix) weights."""
    if isinstance(module, (*_NOT_GEMMS, QuantizedModule, nn.Linear)) or _is_conv1d(module):
        return False
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


def _conv1d_weight_saved_as_stored(module: nn.Module, state_dict: dict, prefix: str,
                                   _metadata) -> None:
    """Save a converted Conv1D's weight [out, in] in Conv1D's layout [in, out]."""
    key = prefix + "weight"
    if isinstance(state_dict.get(key), torch.Tensor):
        state_dict[key] = state_dict[key].t().contiguous()  # safetensors wants contiguous


def _conv1d_weight_loaded_transposed(module: nn.Module, state_dict: dict, prefix: str,
                                     *_) -> None:
    key = prefix + "weight"
    if isinstance(state_dict.get(key), torch.Tensor) and state_dict[key].dim() == 2:
        state_dict[key] = state_dict[key].t()


def _linear_like(child: nn.Module, name: str) -> Linear:
    if _is_conv1d(child):
        in_features, out_features = child.weight.shape
        weight = nn.Parameter(child.weight.detach().t().contiguous(),
                              requires_grad=child.weight.requires_grad)
    else:
        in_features, out_features, weight = child.in_features, child.out_features, child.weight
    replacement = Linear(in_features, out_features, bias=child.bias is not None,
                         params_dtype=child.weight.dtype, device="meta", name=name)
    replacement.weight = weight
    replacement.bias = child.bias
    if _is_conv1d(child):
        replacement.register_state_dict_post_hook(_conv1d_weight_saved_as_stored)
        replacement.register_load_state_dict_pre_hook(_conv1d_weight_loaded_transposed)
    return replacement


def convert_model(
    model: nn.Module,
    recipe: Recipe | None = None,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    strict: bool = False,
) -> nn.Module:
    """Replace each nn.Linear and transformers Conv1D (accepted by filter_fn(name, module))
    with a minifloat.Linear. Returns the model.

    nn.Linear weights and biases are moved, not copied; a Conv1D's weight is transposed once
    (create the optimizer after converting). The report (ConversionReport) is logged on the
    "minifloat" logger, kept as `model.minifloat_conversion`, and a warning names layers
    left in high precision for their shape or their unknown type, or says that nothing was
    converted. strict=True raises a ValueError instead of skipping those.
    """
    report = ConversionReport()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full_name = f"{parent_name}.{child_name}" if parent_name else child_name
            kind = type(child).__name__
            if fused_experts_layout(child):
                _convert_experts(parent, child_name, child, full_name, recipe, filter_fn,
                                 report)
                continue
            if type(child) is not nn.Linear and not _is_conv1d(child):
                if _unknown_gemm(child) and "Router" in kind:
                    report.skipped.append((full_name, kind, _ROUTER))
                elif _unknown_gemm(child):
                    report.skipped.append((full_name, kind, "unknown module type holding "
                                           "matrix weights: runs in high precision"))
                continue
            if filter_fn is not None and not filter_fn(full_name, child):
                report.skipped.append((full_name, kind, _FILTERED))
                continue
            shape = (tuple(child.weight.shape) if type(child) is nn.Linear
                     else tuple(child.weight.shape[::-1]))
            if not _fits_recipe(shape, recipe, full_name):
                report.skipped.append((full_name, kind, "the recipe's formats cannot hold a "
                                       f"weight of shape {list(shape)}: high precision"))
                continue
            setattr(parent, child_name, _linear_like(child, full_name))
            report.converted.append((full_name, kind, shape))
    model.minifloat_conversion = report
    _keep_recipe_state_out_of_hf_checkpoints(model, report)
    LOGGER.info("%s", report)
    _complain(report, strict)
    return model


def _convert_experts(parent: nn.Module, child_name: str, child: nn.Module, name: str,
                     recipe: Recipe | None, filter_fn, report: ConversionReport) -> None:
    """transformers' fused experts (3-D gate_up_proj / down_proj) -> FusedExperts, if the
    filter and the recipe accept both expert GEMMs and the module computes what FusedExperts
    does (checked on a few tokens)."""
    kind = type(child).__name__
    if filter_fn is not None and not filter_fn(name, child):
        report.skipped.append((name, kind, _FILTERED))
        return
    shapes = [tuple(child.gate_up_proj.shape[1:]), tuple(child.down_proj.shape[1:])]
    for shape in shapes:
        if not _fits_recipe(shape, recipe, name):
            report.skipped.append((name, kind, "the recipe's formats cannot hold an expert "
                                   f"weight of shape {list(shape)}: high precision"))
            return
    if child.gate_up_proj.device.type == "meta":
        report.skipped.append((name, kind, "fused experts on the meta device cannot be checked "
                               "against FusedExperts: convert after the weights are loaded"))
        return
    replacement = FusedExperts(child, name=name)
    if not computes_like(child, replacement):
        report.skipped.append((name, kind, "fused experts that do not compute as Mixtral's "
                               "(gate/up halves, layout): high precision"))
        return
    setattr(parent, child_name, replacement)
    report.converted.append((name, kind, tuple(child.gate_up_proj.shape)))


def _keep_recipe_state_out_of_hf_checkpoints(model: nn.Module, report: ConversionReport
                                             ) -> None:
    """A transformers model's save_pretrained writes every state-dict value as a tensor
    (safetensors); a module's recipe state (`_extra_state`, bytes) is none. Such models list
    keys to leave out in `_keys_to_ignore_on_save`: the converted layers' recipe state goes
    there, so save_pretrained writes the weights, as the checkpoints users publish hold. An
    exact resume (delayed scaling's histories) saves with torch.save or DCP instead."""
    if not hasattr(model, "_keys_to_ignore_on_save"):
        return
    keys = set(model._keys_to_ignore_on_save or ())
    model._keys_to_ignore_on_save = keys | {f"{name}._extra_state"
                                            for name, _, _ in report.converted}


def _complain(report: ConversionReport, strict: bool) -> None:
    unconverted = [entry for entry in report.skipped if entry[2] not in (_FILTERED, _ROUTER)]
    if strict and unconverted:
        raise ValueError("convert_model(strict=True): these layers would stay in high "
                         "precision: " + "; ".join(f"{n} ({k}): {r}" for n, k, r in unconverted))
    if unconverted:
        warnings.warn("convert_model left these layers in high precision: " + "; ".join(
            f"{n} ({k}): {r}" for n, k, r in unconverted), stacklevel=3)
    if not report.converted:
        warnings.warn("convert_model converted no layer: the model has no nn.Linear or Conv1D "
                      "layer the filter and the recipe accept, so it trains in high precision",
                      stacklevel=3)
