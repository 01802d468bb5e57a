"""The reference numerics give the same bytes on CUDA tensors as on CPU tensors.

CPU results are the reference (tested against independent computations in tests/numerics); a
CUDA run of the same pure-torch code must not drift through different rounding, reductions or
bit tricks on the device.
"""

import pytest
import torch

import minifloat as mf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUANTIZERS = {
    "fp8_current_e4m3": lambda: mf.Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
    "fp8_current_e5m2_pow2": lambda: mf.Float8CurrentScalingQuantizer(
        torch.float8_e5m2, power_2_scale=True
    ),
    "block_1d": lambda: mf.Float8BlockQuantizer(1),
    "block_2d": lambda: mf.Float8BlockQuantizer(2),
    "block_1d_no_pow2": lambda: mf.Float8BlockQuantizer(1, power_2_scale=False),
    "mxfp8": lambda: mf.MXFP8Quantizer(),
    "nvfp4_1d": lambda: mf.NVFP4Quantizer(),
    "nvfp4_rht": lambda: mf.NVFP4Quantizer(with_rht=True),
    "nvfp4_2d": lambda: mf.NVFP4Quantizer(with_2d_quantization=True),
}


def adversarial_input(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 131 + cols)
    x = torch.randn(rows, cols, generator=generator)
    x *= torch.exp2(torch.randint(-12, 12, (rows, 1), generator=generator).float())
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 3.0e4  # one huge value among small ones
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 2)  # ties
    x[3, 7] = 2.0**-130  # fp32 subnormal
    return x.to(dtype)


def assert_same(expected: torch.Tensor, actual: torch.Tensor, label: str) -> None:
    """Bytes equal for 1-byte buffers; for fp32 scales/amaxes equal values, NaN matching NaN."""
    if expected.dtype == torch.uint8:
        assert torch.equal(expected, actual), label
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=label)


def buffers(storage) -> dict[str, torch.Tensor]:
    out = {}
    for name in storage.tensor_fields():
        value = getattr(storage, name)
        if value is not None:
            raw = value.detach().cpu().contiguous()
            out[name] = raw.view(torch.uint8) if raw.element_size() == 1 else raw
    return out


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 512), (96, 160)])
def test_cuda_bytes_equal_cpu(name, dtype, shape):
    x = adversarial_input(*shape, dtype)
    cpu = QUANTIZERS[name]()(x).quantized_storage
    cuda = QUANTIZERS[name]()(x.cuda()).quantized_storage
    assert cuda.device.type == "cuda"
    expected, actual = buffers(cpu), buffers(cuda)
    assert expected.keys() == actual.keys()
    for field in expected:
        assert_same(expected[field], actual[field], f"{name}: {field} differs on CUDA")
    torch.testing.assert_close(
        cuda.dequantize().cpu(), cpu.dequantize(), rtol=0, atol=0, equal_nan=True
    )


def test_nan_and_inf_survive_on_cuda():
    x = adversarial_input(64, 64, torch.float32)
    x[4, 3] = float("nan")
    x[5, 9] = float("inf")
    for name in ("fp8_current_e4m3", "mxfp8", "nvfp4_1d", "block_1d"):
        cpu = QUANTIZERS[name]()(x).quantized_storage
        cuda = QUANTIZERS[name]()(x.cuda()).quantized_storage
        for field, value in buffers(cpu).items():
            assert_same(value, buffers(cuda)[field], f"{name}: {field}")
        assert torch.isnan(cuda.dequantize()[4, 3])


@pytest.mark.parametrize(
    "recipe",
    [mf.Float8CurrentScaling(), mf.Float8BlockScaling(), mf.MXFP8BlockScaling(),
     mf.NVFP4BlockScaling(disable_stochastic_rounding=True)],
    ids=["current", "block", "mxfp8", "nvfp4"],
)
def test_linear_on_cuda_matches_cpu(recipe):
    torch.manual_seed(0)
    cpu_layer = mf.Linear(128, 64, params_dtype=torch.float32)
    cuda_layer = mf.Linear(128, 64, params_dtype=torch.float32, device="cuda")
    cuda_layer.load_state_dict(cpu_layer.state_dict())
    x = torch.randn(64, 128)
    results = []
    for layer, device in ((cpu_layer, "cpu"), (cuda_layer, "cuda")):
        inp = x.detach().to(device).requires_grad_()
        with mf.autocast(recipe=recipe):
            y = layer(inp)
        y.square().sum().backward()
        results.append((y.detach().cpu(), inp.grad.cpu(), layer.weight.grad.cpu()))
    # Same quantized operands; the GEMMs may sum in another order on the GPU. FP8 GEMMs run on
    # Hopper's FP8 tensor cores (scaled_mm), whose accumulation keeps fewer bits than fp32
    # between promotions (fast accumulation on fprop): compare those by relative error. dY = 2y
    # inherits y's difference and is then quantized, so the backward differs a little more
    # (measured 2.2e-3 on an H100).
    fp8_tensor_cores = isinstance(recipe, mf.Float8CurrentScaling | mf.Float8BlockScaling)
    for cpu_value, cuda_value in zip(results[0], results[1], strict=True):
        if fp8_tensor_cores:
            error = (torch.linalg.norm((cuda_value - cpu_value).double())
                     / torch.linalg.norm(cpu_value.double())).item()
            assert error < 5e-3
        else:
            torch.testing.assert_close(cuda_value, cpu_value, rtol=1e-4, atol=1e-4)
