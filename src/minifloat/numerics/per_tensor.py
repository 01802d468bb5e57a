"""Per-tensor FP8: current scaling and the delayed-scaling update (NUMERICS.md §2, §3).

All scale arithmetic is fp32 on device tensors; special cases are `torch.where`, never Python
branches on values, so these functions run inside a training step without a host sync.
"""

from __future__ import annotations

import torch

from .formats import FLT_MAX, cast_to_fp8, clear_mantissa, fp8_format, fp32_divide


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a 0-dim fp32 tensor; NaN anywhere gives NaN, an empty tensor gives 0."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.amax(x.detach().abs()).float()


def scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    overflow_value: float = FLT_MAX,
) -> torch.Tensor:
    """Encode scale for amax (§2 steps 2-3), elementwise over any shape of amaxes.

    amax is raised to amax_epsilon; scale = fp8_max / amax in fp32; a zero, infinite or NaN amax
    gives scale 1; an infinite scale (tiny amax) becomes `overflow_value` (FLT_MAX for per-tensor
    scaling, the input dtype's max for block scaling); power-of-2 scales round down.
    """
    amax = amax.float()
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    scale = fp32_divide(fp8_max, amax)
    degenerate = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(degenerate, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, overflow_value), scale)
    if power_2_scale:
        scale = clear_mantissa(scale)
    return scale


def quantize_with_scale(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """data = sat_rne(x * scale) (fp32 product) and scale_inv = 1 / scale (§2 step 4)."""
    data = cast_to_fp8(x.float() * scale, dtype)
    return data, torch.reciprocal(scale.float())


def quantize_current_scaling(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    amax: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling: returns (data in `dtype`, scale_inv as a 0-dim fp32 tensor).

    `amax` may be given when it was reduced across ranks; otherwise it is computed from x.
    The columnwise copy is `data.t()` of the 2D view with the same scale_inv (§2 step 5).
    """
    if amax is None:
        amax = compute_amax(x)
    scale = scale_from_amax(
        amax, fp8_format(dtype).max_value, amax_epsilon=amax_epsilon, power_2_scale=power_2_scale
    )
    return quantize_with_scale(x, scale, dtype)


def dequantize_per_tensor(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """data * scale_inv in fp32, then cast to `dtype`."""
    return (data.float() * scale_inv.float()).to(dtype)


def delayed_scaling_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: float | torch.Tensor,
    *,
    margin: int = 0,
    amax_compute_algo: str = "max",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update (§3) for a history [history_len, n_slots] and scales [n_slots].

    Returns (new_history, new_scale); the caller copies them into its state. `fp8_max` may be a
    per-slot tensor (E4M3 forward slots, E5M2 gradient slots). The amax all-reduce, when asked
    for, happens before this call on slot 0.
    """
    if amax_compute_algo == "max":
        amax = torch.amax(amax_history, dim=0)
    elif amax_compute_algo == "most_recent":
        amax = amax_history[0]
    else:
        raise ValueError(
            f"unknown amax_compute_algo {amax_compute_algo!r}: use 'max' or 'most_recent'"
        )
    new_history = torch.roll(amax_history, shifts=-1, dims=0)
    new_history[0].zero_()
    candidate = fp32_divide(fp8_max, amax.float()) / (2.0**margin)
    valid = (amax > 0) & torch.isfinite(amax)
    candidate = torch.where(torch.isinf(candidate), torch.full_like(candidate, FLT_MAX), candidate)
    new_scale = torch.where(valid, candidate, scale.float())
    return new_history, new_scale
