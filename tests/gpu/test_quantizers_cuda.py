"""Quantizers on CUDA tensors: every buffer's bytes equal the CPU quantization of the same input
(the CPU path is the numerics reference), dequantize agrees, in-place updates, device moves and
stochastic-rounding statistics. Skipped without CUDA."""

from __future__ import annotations

import io

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import minifloat as mf  # noqa: E402

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CUDA = torch.device("cuda")


def _delayed(dtype):
    def make(device, **usage):
        scale = torch.tensor([32.0], device=device)
        return mf.Float8Quantizer(scale, torch.zeros(1, device=device), dtype, **usage)

    return make


def _plain(factory):
    def make(device, **usage):
        return factory(**usage)

    return make


FAMILIES = {
    "delayed_e4m3": (_delayed(E4M3), None),
    "delayed_e5m2": (_delayed(E5M2), None),
    "current_e4m3": (_plain(lambda **u: mf.Float8CurrentScalingQuantizer(E4M3, **u)), None),
    "current_e5m2": (_plain(lambda **u: mf.Float8CurrentScalingQuantizer(E5M2, **u)), None),
    "current_pow2_eps": (
        _plain(lambda **u: mf.Float8CurrentScalingQuantizer(
            E4M3, power_2_scale=True, amax_epsilon=1e-3, **u)),
        None,
    ),
    "block_1d": (_plain(lambda **u: mf.Float8BlockQuantizer(1, **u)), None),
    "block_2d": (_plain(lambda **u: mf.Float8BlockQuantizer(2, **u)), None),
    "block_1d_no_pow2": (_plain(lambda **u: mf.Float8BlockQuantizer(1, power_2_scale=False, **u)),
                         None),
    "mxfp8": (_plain(lambda **u: mf.MXFP8Quantizer(**u)), 32),
    "mxfp8_e5m2": (_plain(lambda **u: mf.MXFP8Quantizer(E5M2, **u)), 32),
    "nvfp4": (_plain(lambda **u: mf.NVFP4Quantizer(**u)), 16),
    "nvfp4_rht": (_plain(lambda **u: mf.NVFP4Quantizer(with_rht=True, **u)), 16),
    "nvfp4_2d": (_plain(lambda **u: mf.NVFP4Quantizer(with_2d_quantization=True, **u)), 16),
    "identity": (_plain(lambda **u: mf.IdentityQuantizer(**u)), None),
    "identity_bf16": (_plain(lambda **u: mf.IdentityQuantizer(torch.bfloat16, **u)), None),
}
NAMES = list(FAMILIES)
USAGES = [(True, False), (False, True), (True, True)]
USAGE_IDS = ["rowwise", "columnwise", "both"]


def shapes_for(name):
    block = FAMILIES[name][1]
    if block:
        return [(64, 128), (2, 16, 64), (1024, 2048)] if block == 32 else [
            (64, 128), (2, 8, 32), (1024, 2048), (48, 80)]
    return [(64, 128), (2, 3, 64), (200, 300), (1024, 2048), (3, 5)]


def quantize(name, x, usage=(True, True), internal=True):
    make, _ = FAMILIES[name]
    q = make(x.device, rowwise=usage[0], columnwise=usage[1], internal=internal)
    return q(x)


def as_bytes(t):
    dense = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return dense.view(torch.uint8)


def assert_same_storage(cuda_storage, cpu_storage, what=""):
    assert type(cuda_storage) is type(cpu_storage)
    assert cuda_storage.shape == cpu_storage.shape and cuda_storage.dtype == cpu_storage.dtype
    for n in cpu_storage.tensor_fields():
        a, b = getattr(cuda_storage, n), getattr(cpu_storage, n)
        assert (a is None) == (b is None), f"{what}{n}: presence differs"
        if b is None:
            continue
        assert a.device.type == "cuda", f"{what}{n} is on {a.device}"
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}{n}"
        mismatch = (as_bytes(a.cpu()) != as_bytes(b)).sum().item()
        assert mismatch == 0, f"{what}{n}: {mismatch} of {as_bytes(b).numel()} bytes differ"
    for n in cpu_storage.metadata_fields:
        assert getattr(cuda_storage, n) == getattr(cpu_storage, n), n


def _input(shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    # a spread of magnitudes across rows: different block scales, subnormals in some blocks
    rows = x.reshape(-1, shape[-1]).shape[0]
    x = (x.reshape(rows, -1) * torch.logspace(-8, 8, rows, base=2.0)[:, None]).reshape(shape)
    return x.to(dtype)


# --------------------------------------------------------------------------------------------
# bytes: CUDA == CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_cuda_bytes_equal_cpu(name, usage):
    for i, shape in enumerate(shapes_for(name)):
        x = _input(shape, seed=i)
        cpu = quantize(name, x, usage)
        cuda = quantize(name, x.to(CUDA), usage)
        assert cuda.device.type == "cuda"
        assert_same_storage(cuda, cpu, f"{name}{shape}.")
        values = cuda.dequantize()
        assert values.device.type == "cuda"
        assert torch.equal(values.cpu(), cpu.dequantize())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_cuda_bytes_equal_cpu_low_precision_inputs(name, dtype):
    shape = shapes_for(name)[0]
    x = _input(shape, seed=11, dtype=dtype)
    assert_same_storage(quantize(name, x.to(CUDA)), quantize(name, x), f"{name}.")


def _adversarial(shape, kind):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(12))
    flat = x.view(-1)
    if kind == "zeros":
        x.zero_()
    elif kind == "huge":
        flat[17] = 1e4
    elif kind == "inf":
        flat[17], flat[40] = float("inf"), float("-inf")
    elif kind == "tiny":
        x *= 1e-39
    elif kind == "ties":
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0625, 1.1875, 272.0])
        flat[: grid.numel()] = grid
        flat[grid.numel()] = 448.0
    return x


@pytest.mark.parametrize("kind", ["zeros", "huge", "inf", "tiny", "ties"])
@pytest.mark.parametrize("name", NAMES)
def test_cuda_bytes_equal_cpu_adversarial(name, kind):
    x = _adversarial(shapes_for(name)[0], kind)
    cpu = quantize(name, x)
    cuda = quantize(name, x.to(CUDA))
    assert_same_storage(cuda, cpu, f"{name}/{kind}.")
    assert torch.equal(cuda.dequantize().cpu().isnan(), cpu.dequantize().isnan())


@pytest.mark.parametrize("name", NAMES)
def test_cuda_nan_stays_nan(name):
    x = _input(shapes_for(name)[0], seed=13)
    x.view(-1)[5] = float("nan")
    for usage in ((True, False), (False, True)):
        cuda_values = quantize(name, x.to(CUDA), usage).dequantize().cpu()
        cpu_values = quantize(name, x, usage).dequantize()
        assert torch.isnan(cuda_values.reshape(-1)[5])
        assert torch.equal(cuda_values.isnan(), cpu_values.isnan())
        finite = ~cpu_values.isnan()
        assert torch.equal(cuda_values[finite], cpu_values[finite])


# --------------------------------------------------------------------------------------------
# stochastic rounding on CUDA: statistics
# --------------------------------------------------------------------------------------------

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _decode_e2m1(packed):
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    magnitude = E2M1_GRID.to(packed.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def _neighbours(units):
    """(largest E2M1 magnitude <= |u|, smallest >= |u|) with a 1e-5 relative margin."""
    lo = (units.abs() * (1 - 1e-5)).clamp(max=6.0).reshape(-1, 1)
    hi = (units.abs() * (1 + 1e-5)).clamp(max=6.0).reshape(-1, 1)
    lower = E2M1_GRID[(E2M1_GRID[None, :] <= lo).sum(1) - 1]
    upper = E2M1_GRID[torch.clamp(8 - (E2M1_GRID[None, :] >= hi).sum(1), max=7)]
    return lower.reshape(units.shape), upper.reshape(units.shape)


@pytest.mark.parametrize("options", [{}, {"with_rht": True}, {"with_2d_quantization": True}],
                         ids=["1d", "rht", "2d"])
def test_cuda_stochastic_rounding_neighbours_and_scales(options):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(14))
    rne = mf.NVFP4Quantizer(internal=True, **options)(x)
    torch.cuda.manual_seed(15)
    sr = mf.NVFP4Quantizer(stochastic_rounding=True, internal=True, **options)(x.to(CUDA))
    for prefix, amax in (("rowwise", "amax_rowwise"), ("columnwise", "amax_columnwise")):
        # SR touches elements only: scales and amax equal the CPU RNE ones byte for byte
        for n in (f"{prefix}_scale", amax):
            assert torch.equal(as_bytes(getattr(sr, n).cpu()), as_bytes(getattr(rne, n))), n
        source = x if prefix == "rowwise" else x.t()
        if prefix == "columnwise" and options.get("with_rht"):
            source = mf.numerics.random_hadamard_transform(x.t().contiguous()).float()
        s_dec = getattr(rne, amax).item() / 2688.0
        block_scale = getattr(rne, f"{prefix}_scale").float().repeat_interleave(16, 1)
        lower, upper = _neighbours(source / (block_scale * s_dec))
        got = _decode_e2m1(getattr(sr, f"{prefix}_data").cpu())
        assert ((got.abs() >= lower) & (got.abs() <= upper)).all(), prefix
        assert ((got == 0) | (torch.sign(got) == torch.sign(source))).all(), prefix
        nearest = _decode_e2m1(getattr(rne, f"{prefix}_data"))
        differs = (got != nearest).float().mean().item()
        assert 0.1 < differs < 0.6, differs


def test_cuda_stochastic_rounding_is_unbiased():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(16))
    copies = 512
    stacked = x.repeat(copies, 1).to(CUDA)
    torch.cuda.manual_seed(17)
    values = mf.NVFP4Quantizer(stochastic_rounding=True, columnwise=False)(stacked)
    values = values.dequantize().reshape(copies, 32, 64).cpu()
    rne = mf.NVFP4Quantizer(columnwise=False)(x).dequantize()
    rne_error = ((rne - x).norm() / x.norm()).item()
    mean_error = ((values.mean(0) - x).norm() / x.norm()).item()
    assert mean_error < rne_error / 4, (mean_error, rne_error)
    diff = values - x
    assert abs(diff.mean().item()) < 4 * diff.std().item() / diff.numel() ** 0.5 + 1e-7


# --------------------------------------------------------------------------------------------
# in-place updates, device moves, delayed-scaling state, serialization
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_cuda_update_quantized_in_place(name):
    shape = shapes_for(name)[0]
    dst = quantize(name, _input(shape, 18).to(CUDA), internal=False)
    storage = dst.quantized_storage
    pointers = {n: getattr(storage, n).data_ptr() for n in storage.tensor_fields()
                if getattr(storage, n) is not None}
    x_new = _input(shape, 19) * 3
    make, _ = FAMILIES[name]
    make(CUDA).update_quantized(x_new.to(CUDA), dst)
    for n, ptr in pointers.items():
        assert getattr(storage, n).data_ptr() == ptr, n
    assert_same_storage(storage, quantize(name, x_new), f"{name}.")


@pytest.mark.parametrize("name", NAMES)
def test_device_moves_keep_the_bytes(name):
    x = _input(shapes_for(name)[0], 20)
    cpu = quantize(name, x, internal=False)
    on_cuda = cpu.to(CUDA)
    assert isinstance(on_cuda, mf.QuantizedTensor) and on_cuda.device.type == "cuda"
    assert_same_storage(on_cuda.quantized_storage, cpu.quantized_storage, f"{name}.")
    back = on_cuda.to("cpu")
    assert isinstance(back, mf.QuantizedTensor) and back.device.type == "cpu"
    assert torch.equal(back.dequantize(), cpu.dequantize())
    plain = on_cuda.to(torch.float16)
    assert type(plain) is torch.Tensor and plain.device.type == "cuda"
    assert torch.equal(plain.cpu(), cpu.dequantize(torch.float16))


@pytest.mark.parametrize("name", NAMES)
def test_cuda_save_and_load(name):
    x = _input(shapes_for(name)[0], 21)
    cuda = quantize(name, x.to(CUDA), internal=False)
    buffer = io.BytesIO()
    torch.save(cuda, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded, mf.QuantizedTensor) and loaded.device.type == "cuda"
    assert_same_storage(loaded.quantized_storage, quantize(name, x), f"{name}.")
    buffer.seek(0)
    on_cpu = torch.load(buffer, weights_only=True, map_location="cpu")
    assert on_cpu.device.type == "cpu"
    assert torch.equal(on_cpu.dequantize(), quantize(name, x).dequantize())


def test_cuda_delayed_scaling_state_stays_on_device():
    scale = torch.tensor([16.0], device=CUDA)
    amax = torch.zeros(1, device=CUDA)
    q = mf.Float8Quantizer(scale, amax)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(22))
    out = q(x.to(CUDA))
    assert amax.device.type == "cuda" and amax.item() == x.abs().max().item()
    expected = (x * 16.0).clamp(-448, 448).to(E4M3)
    assert torch.equal(as_bytes(out.quantized_storage.data.cpu()), as_bytes(expected))
    q(x.to(CUDA) * 0.5)
    assert amax.item() == x.abs().max().item()
    scale.fill_(4.0)
    out = q(x.to(CUDA))
    assert out.quantized_storage.scale_inv.item() == 0.25
