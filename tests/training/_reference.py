"""Independent references for the training-path tests, composed only of minifloat.numerics.

Every GEMM here follows the TN rule of DESIGN.md §3-4 written out by hand: each operand is laid
out as [rows, reduction], quantized along its reduction dim with that operand's format (the
columnwise copy of a tensor is, by NUMERICS.md §2-6, the rowwise quantization of its transpose,
except for per-tensor FP8 and 2D tiles where it is the exact transpose), decoded exactly, then
multiplied in fp32 with torch.matmul; per-tensor factors (FP8 scale_inv, NVFP4 S_dec) are applied
after accumulation as one fp32 alpha, then the bias, then the cast to the output dtype.

Nothing here calls minifloat's quantizers, storages, general_gemm or modules.
"""

from __future__ import annotations

import torch

from minifloat import numerics

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def mm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, R] times b [N, R]^T in fp32 (both operands contiguous, reduction dim last)."""
    return torch.matmul(a.float().contiguous(), b.float().contiguous().t())


def finish(acc, alpha=None, bias=None, out_dtype=torch.float32):
    out = acc
    if alpha is not None:
        out = out * alpha
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ---- one operand, laid out [rows, reduction], quantized along the reduction dim ----
# Each returns (fp32 decoded values [rows, reduction], per-tensor alpha or None).


def op_current(t: torch.Tensor, dtype: torch.dtype):
    data, scale_inv = numerics.quantize_current_scaling(t, dtype)
    return data.float(), scale_inv.float().reshape(())


def op_delayed(t: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype):
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(())
    data, scale_inv = numerics.quantize_with_scale(t, scale, dtype)
    return data.float(), scale_inv.float().reshape(())


def op_block_1d(t: torch.Tensor):
    data, scale_inv = numerics.quantize_block_1d(t.contiguous())
    return numerics.dequantize_block_1d(data, scale_inv), None


def op_block_2d(t: torch.Tensor):
    data, scale_inv = numerics.quantize_block_2d(t.contiguous())
    return numerics.dequantize_block_2d(data, scale_inv), None


def op_mxfp8(t: torch.Tensor, dtype: torch.dtype = E4M3):
    out = numerics.quantize_mxfp8(t.contiguous(), rowwise=True, dtype=dtype)
    return numerics.dequantize_mxfp8(out["rowwise_data"], out["rowwise_scale"]), None


def op_nvfp4(t: torch.Tensor, *, two_dimensional: bool = False, rht: bool = False):
    """NVFP4 1x16 blocks (or 16x16 tiles); with rht, the transform of NUMERICS.md §6 is applied
    to the [rows, reduction] layout (runs of 16 along the reduction dim) before quantizing."""
    if rht:
        t = numerics.random_hadamard_transform(t.contiguous())
    out = numerics.quantize_nvfp4(t.contiguous(), rowwise=True, two_dimensional=two_dimensional)
    values = numerics.dequantize_nvfp4_blocks(out["rowwise_data"], out["rowwise_scale"])
    return values, numerics.global_decode_scale(out["amax_rowwise"]).float().reshape(())


def gemm(a_op, b_op, bias=None, out_dtype=torch.float32):
    """Combine two operands from the op_* functions into A @ B^T (fp32 accumulate)."""
    (a, a_alpha), (b, b_alpha) = a_op, b_op
    alpha = None
    for factor in (a_alpha, b_alpha):
        if factor is not None:
            alpha = factor if alpha is None else alpha * factor
    return finish(mm_tn(a, b), alpha, bias, out_dtype)


# ---- a whole Linear layer: y = x W^T + b, dx = dy W, dw = dy^T x, db = sum(dy) ----


def linear_reference(kind: str, x, w, b, dy, *, scales=None, wgrad_dtype=None):
    """(y, dx, dw, db) of a Linear under recipe `kind`, from numerics only.

    kind: "current" (Float8CurrentScaling, HYBRID), "delayed" (DelayedScaling, HYBRID, with the
    per-slot scales in `scales` = dict(input=, weight=, grad_output=), default 1), "block"
    (Float8BlockScaling: x, dy 1D; W 2D), "mxfp8" (E4M3 everywhere), "nvfp4" (NVFP4BlockScaling
    with SR disabled: W 16x16 no RHT, x and dy 1x16 with RHT on the wgrad operands).
    dw is cast to `wgrad_dtype` (default: the weight's dtype; fp32 for a main_grad product).
    """
    in_features = x.shape[-1]
    x2d = x.reshape(-1, in_features)
    dy2d = dy.reshape(-1, w.shape[0])
    out_dtype, w_dtype = x.dtype, wgrad_dtype or w.dtype
    xt, dyt, wt = x2d.t(), dy2d.t(), w.t()
    if kind == "current":
        fx = lambda t: op_current(t, E4M3)  # noqa: E731
        fw = fx
        fg = lambda t: op_current(t, E5M2)  # noqa: E731
        fxc, fwc, fgc = fx, fw, fg
    elif kind == "delayed":
        s = {"input": 1.0, "weight": 1.0, "grad_output": 1.0, **(scales or {})}
        fx = fxc = lambda t: op_delayed(t, s["input"], E4M3)  # noqa: E731
        fw = fwc = lambda t: op_delayed(t, s["weight"], E4M3)  # noqa: E731
        fg = fgc = lambda t: op_delayed(t, s["grad_output"], E5M2)  # noqa: E731
    elif kind == "block":
        fx = fxc = fg = fgc = op_block_1d
        fw = fwc = op_block_2d
    elif kind == "mxfp8":
        fx = fxc = fw = fwc = fg = fgc = op_mxfp8
    elif kind == "nvfp4":
        fx = fg = op_nvfp4
        fw = fwc = lambda t: op_nvfp4(t, two_dimensional=True)  # noqa: E731
        fxc = fgc = lambda t: op_nvfp4(t, rht=True)  # noqa: E731
    else:
        raise ValueError(kind)
    if kind in ("current", "delayed"):
        # Per-tensor FP8: the columnwise copy is the byte transpose of the rowwise data, with
        # the same scale (NUMERICS.md §2 step 5); the amax of x^T is the amax of x.
        def transposed(f, t):
            values, alpha = f(t.t())
            return values.t(), alpha

        xcol = transposed(fx, xt)
        wcol = transposed(fw, wt)
        gcol = transposed(fg, dyt)
    else:
        xcol, wcol, gcol = fxc(xt), fwc(wt), fgc(dyt)
    y = gemm(fx(x2d), fw(w), bias=b, out_dtype=out_dtype)
    dx = gemm(fg(dy2d), wcol, out_dtype=out_dtype)
    dw = gemm(gcol, xcol, out_dtype=w_dtype)
    db = dy2d.sum(dim=0) if b is not None else None
    return (
        y.reshape(*x.shape[:-1], w.shape[0]),
        dx.reshape(x.shape),
        dw,
        db,
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ||actual - expected|| / ||expected||, in float64."""
    actual, expected = actual.double(), expected.double()
    return (torch.linalg.norm(actual - expected) / torch.linalg.norm(expected)).item()


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.detach().contiguous().view(torch.uint8)
    e = expected.detach().contiguous().view(torch.uint8)
    if not torch.equal(a, e):
        diff = (actual.double() - expected.double()).abs()
        raise AssertionError(
            f"{what}: not bit-equal; {(a != e).sum().item()} bytes differ, max abs diff "
            f"{diff.max().item():.3e}"
        )
