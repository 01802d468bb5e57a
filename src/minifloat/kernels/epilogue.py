"""The emulated GEMM's epilogue in one pass: out = cast(product * alpha + bias).

An emulated NVFP4 GEMM (gemm_paths.bf16_gemm) accumulates in fp32 and only then applies the
per-tensor factor alpha (S_dec of A times S_dec of B), the bias and the cast to the output dtype
(NUMERICS.md §8). Written as torch ops that is three passes over an fp32 [M, N] product (a
multiply, an add, a cast: 18 bytes an element, ~1.1 ms a Linear step at 16384x8192x8192 on an
H100). This kernel reads the product once and writes the output once (6 bytes an element for a
bf16 output), with alpha read from device memory (no host sync).

Bit-exact against the torch ops: the same fp32 multiply and add, each rounded to nearest even
(the kernel is compiled without floating-point fusion: the compiler would otherwise contract
them into one FMA with one rounding), then one round-to-nearest-even cast to the output dtype.
"""

from __future__ import annotations

import torch

from .element_cast import round_to_bf16
from .fp8_common import cdiv, jit, tl
from .launch import launch

EPILOGUE_BLOCK = 2048
EPILOGUE_WARPS = 8
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@jit
def _scale_bias_cast_kernel(product_ptr, alpha_ptr, alpha2_ptr, bias_ptr, out_ptr, n, N,
                            ALPHAS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BF16_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """ALPHAS factors (0, 1 or 2: alpha, or alpha * alpha2 rounded once to fp32, the two
    operands' S_dec as the reference multiplies them)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(product_ptr + offsets, mask=mask, other=0.0)
    if ALPHAS == 2:
        value = value * (tl.load(alpha_ptr) * tl.load(alpha2_ptr))
    elif ALPHAS == 1:
        value = value * tl.load(alpha_ptr)
    if HAS_BIAS:
        value = value + tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    if BF16_OUT:
        # out_ptr is the int16 view of the bf16 output: the rounding is done on the bits, so
        # every backend writes the same bytes (the interpreter's own bf16 cast does not round
        # to nearest even, nor keep subnormals)
        bits = round_to_bf16(value).to(tl.int32, bitcast=True) >> 16
        tl.store(out_ptr + offsets, bits.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


def scale_bias_cast(
    product: torch.Tensor,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    alpha2: torch.Tensor | None = None,
) -> torch.Tensor:
    """cast(product * alpha + bias) to out_dtype in one pass; the bytes of the torch ops
    `(product * alpha.float() + bias.float()).to(out_dtype)`, with alpha = alpha.float() *
    alpha2.float() where a second factor is given.

    product: contiguous fp32 [M, N]; alpha, alpha2: 1-element fp32 tensors on the same device
    (or None); bias: N values (or None).

    Why a second factor: an NVFP4 x NVFP4 GEMM's alpha is the product of its operands' S_dec;
    multiplied here, it costs no launch of its own (one tiny kernel per GEMM otherwise).
    """
    if alpha is None:
        alpha, alpha2 = alpha2, None
    if product.dtype != torch.float32 or product.dim() != 2 or not product.is_contiguous():
        raise ValueError("scale_bias_cast needs a contiguous 2-D float32 product; got "
                         f"{product.dtype}, shape {tuple(product.shape)}")
    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"scale_bias_cast writes one of {OUTPUT_DTYPES}, not {out_dtype}")
    for factor in (alpha, alpha2):
        if factor is not None and (factor.numel() != 1 or factor.device != product.device):
            raise ValueError("scale_bias_cast: alpha must be one value on the product's device")
    n_cols = product.shape[1]
    if bias is not None and (bias.numel() != n_cols or bias.device != product.device):
        raise ValueError(f"scale_bias_cast: bias must hold {n_cols} values (one per output "
                         f"column) on the product's device; got {bias.numel()}")
    out = torch.empty(product.shape, dtype=out_dtype, device=product.device)
    n = product.numel()
    if n == 0:
        return out
    alpha_arg = product if alpha is None else alpha.reshape(1).float()
    alpha2_arg = product if alpha2 is None else alpha2.reshape(1).float()
    bias_arg = product if bias is None else bias.reshape(-1).contiguous()
    bf16_out = out_dtype == torch.bfloat16
    launch(_scale_bias_cast_kernel, (cdiv(n, EPILOGUE_BLOCK),), product, alpha_arg, alpha2_arg,
           bias_arg, out.view(torch.int16) if bf16_out else out, n, n_cols,
           ALPHAS=(alpha is not None) + (alpha2 is not None), HAS_BIAS=bias is not None,
           BF16_OUT=bf16_out,
           BLOCK=EPILOGUE_BLOCK, num_warps=EPILOGUE_WARPS,
           options={"enable_fp_fusion": False})  # an FMA would round once, not twice
    return out
