"""The one-pass GEMM epilogue (kernels/epilogue.py) against the torch ops it replaces.

cast(product * alpha + bias) must equal `(product * alpha + bias.float()).to(dtype)` bit for
bit (NaN in the same places): random products over a wide exponent range, values on bf16 and
fp16 rounding ties, overflow to inf, subnormals, NaN and inf in the product and in alpha, shapes
that are not multiples of the block, and each combination of alpha and bias. Runs on CUDA, or
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from minifloat import kernels

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip(
        "needs CUDA with Triton, or TRITON_INTERPRET=1 with Triton", allow_module_level=True
    )

from minifloat.kernels.epilogue import scale_bias_cast  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")]


def reference(product, alpha, bias, dtype):
    value = product if alpha is None else product * alpha.float()
    if bias is not None:
        value = value + bias.float()
    return value.to(dtype)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    bits_a = actual.view(view[actual.dtype])[~nan]
    bits_e = expected.view(view[expected.dtype])[~nan]
    mismatches = (bits_a != bits_e).sum().item()
    assert mismatches == 0, f"{mismatches} elements differ"


def wide_product(shape, seed):
    """fp32 values from ~1e-40 (subnormal) to ~1e38, both signs, plus exact rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(shape, generator=gen) * 2 - 1
    exponent = torch.randint(-135, 128, shape, generator=gen).float()
    values = mantissa * torch.pow(2.0, exponent)
    # bf16 ties: 1 + 2^-8 sits halfway between two bf16 numbers (even and odd neighbours)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8),
                         1 + 2**-11, 1 + 3 * 2**-11, 65520.0, 3.3895e38, float("inf"),
                         float("-inf"), float("nan"), 0.0, -0.0, 1e-45])
    flat = values.reshape(-1)
    count = min(flat.numel(), ties.numel())
    flat[:count] = ties[:count]
    return flat.reshape(shape).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_alpha", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 2048), (129, 515)])
def test_matches_torch_ops_bitwise(dtype, with_alpha, with_bias, shape):
    product = wide_product(shape, seed=shape[0] * 1000 + shape[1])
    alpha = torch.tensor([0.3712], device=DEVICE) if with_alpha else None
    gen = torch.Generator().manual_seed(7)
    bias = ((torch.randn(shape[1], generator=gen) * 100).to(torch.bfloat16).to(DEVICE)
            if with_bias else None)
    assert_same_bits(scale_bias_cast(product, alpha, bias, dtype),
                     reference(product, alpha, bias, dtype))


@pytest.mark.parametrize("alpha_value", [float("nan"), float("inf"), 0.0, 2.0**-149, 3e38])
def test_special_alphas(alpha_value):
    product = wide_product((33, 100), seed=11)
    alpha = torch.tensor([alpha_value], device=DEVICE)
    assert_same_bits(scale_bias_cast(product, alpha, None, torch.bfloat16),
                     reference(product, alpha, None, torch.bfloat16))


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("factors", [(0.3712, 1.7), (3e30, 3e30), (2.0**-100, 2.0**-60),
                                     (float("nan"), 1.0), (None, 0.25)])
def test_two_factors_are_multiplied_as_the_reference_does(with_bias, factors):
    """alpha * alpha2 is rounded to fp32 once before it scales the product (gemm.py's order),
    also where the product of the factors overflows or underflows; a second factor alone acts
    as the only one."""
    product = wide_product((33, 70), seed=11)
    bias = torch.randn(70, device=DEVICE) if with_bias else None
    alpha, alpha2 = (None if f is None else torch.tensor([f], device=DEVICE) for f in factors)
    combined = alpha2 if alpha is None else alpha.float() * alpha2.float()
    assert_same_bits(scale_bias_cast(product, alpha, bias, torch.bfloat16, alpha2=alpha2),
                     reference(product, combined, bias, torch.bfloat16))


def test_fp32_bias_and_empty_product():
    product = wide_product((5, 40), seed=3)
    bias = torch.randn(40, device=DEVICE)
    alpha = torch.tensor(1.7, device=DEVICE)
    assert_same_bits(scale_bias_cast(product, alpha, bias, torch.bfloat16),
                     reference(product, alpha, bias, torch.bfloat16))
    empty = torch.empty((0, 8), device=DEVICE)
    assert scale_bias_cast(empty, alpha, None, torch.bfloat16).shape == (0, 8)


def test_bad_inputs_name_the_problem():
    product = torch.zeros((4, 8), device=DEVICE)
    with pytest.raises(ValueError, match="float32 product"):
        scale_bias_cast(product.to(torch.bfloat16), None, None, torch.bfloat16)
    with pytest.raises(ValueError, match="float32 product"):
        scale_bias_cast(product.t(), None, None, torch.bfloat16)
    with pytest.raises(ValueError, match="one value"):
        scale_bias_cast(product, torch.ones(2, device=DEVICE), None, torch.bfloat16)
    with pytest.raises(ValueError, match="8 values"):
        scale_bias_cast(product, None, torch.ones(4, device=DEVICE), torch.bfloat16)
    with pytest.raises(ValueError, match="writes one of"):
        scale_bias_cast(product, None, None, torch.int8)
