"""One-pass bf16 decodes (kernels/dequantize.py) against numerics dequantization + .to(bf16).

Bit for bit (NaN matching NaN in position, whatever its payload), on random codes and scales,
every FP8 / E2M1 code under every scale byte, scales at the edges of the kernels' short path,
realistic quantized tensors, shapes that are not multiples of the tiles, and 3-D data. Runs on
CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1); skipped otherwise.
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

import minifloat as mf  # noqa: E402
from minifloat import numerics  # noqa: E402
from minifloat.kernels import dequantize  # noqa: E402
from minifloat.quantizers import as_storage  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    # the NVFP4 quantizer under the interpreter evaluates 1 / 0 and overflows through numpy
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
POISON = 0x1234  # a finite bf16 pattern no decode of these inputs produces by accident


def random_bytes(shape, seed, low=0, high=256):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def poisoned(shape):
    return torch.full(shape, POISON, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, label: str = "") -> None:
    """Same shape, bf16, contiguous; equal bits except that NaN must meet NaN."""
    assert actual.dtype == torch.bfloat16 and actual.is_contiguous(), label
    assert actual.shape == expected.shape, (label, actual.shape, expected.shape)
    actual, expected = actual.cpu(), expected.cpu().to(torch.bfloat16).contiguous()
    a, b = actual.view(torch.int16), expected.view(torch.int16)
    nan_a, nan_b = actual.isnan(), expected.isnan()
    bad = (nan_a != nan_b) | (~nan_b & (a != b))
    if bad.any():
        first = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{label}: {int(bad.sum())} of {bad.numel()} values differ, first at {first}: "
            f"{int(a[first]) & 0xFFFF:#06x} instead of {int(b[first]) & 0xFFFF:#06x}"
        )


def mx_reference(data, scale, columnwise):
    """numerics on the CPU (the spec), as the GEMM operand: transposed for columnwise."""
    data, scale = data.cpu(), scale.cpu()
    values = numerics.dequantize_mxfp8(data.reshape(-1, data.shape[-1]),
                                       scale.reshape(-1, scale.shape[-1]), columnwise=columnwise)
    values = values.t() if columnwise else values.reshape(data.shape)
    return values.to(torch.bfloat16)


def check_mx(data_bytes, scale_bytes, dtype, columnwise, label="", block_shape=None):
    data = data_bytes.view(dtype).to(DEVICE)
    scale = scale_bytes.to(DEVICE)
    expected = mx_reference(data, scale, columnwise)
    out = poisoned(tuple(expected.shape))
    result = dequantize.dequantize_mxfp8_bf16(data, scale, columnwise=columnwise, out=out,
                                              block_shape=block_shape)
    assert result.data_ptr() == out.data_ptr()
    assert_bits_equal(result, expected, label)
    fresh = dequantize.dequantize_mxfp8_bf16(data, scale, columnwise=columnwise)
    assert_bits_equal(fresh, expected, label + " (fresh)")
    if columnwise:  # the untransposed columnwise decode, [M, K] (the operand is its .t())
        flat = dequantize.dequantize_mxfp8_bf16(data, scale, columnwise=True, transpose=False,
                                                block_shape=block_shape)
        assert_bits_equal(flat, expected.t().contiguous(), label + " (untransposed)")


def scale_shape(m, k, columnwise, block=32):
    return (m // block, k) if columnwise else (m, k // block)


# ---------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("shape", [(64, 128), (96, 160), (32, 32), (160, 96)])
def test_mxfp8_random_codes_and_scales(dtype, columnwise, shape):
    """Every byte pattern as code and as scale (NaN codes, infinities, subnormal results)."""
    m, k = shape
    data = random_bytes((m, k), seed=m * 1000 + k)
    scale = random_bytes(scale_shape(m, k, columnwise), seed=k * 1000 + m + 1)
    check_mx(data, scale, dtype, columnwise, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
def test_mxfp8_every_code_under_every_scale(dtype, columnwise):
    """One scale byte for a whole tensor holding all 256 codes: every scale 0..255, so both the
    short path (scales inside its range, boundaries included) and the general one run."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = codes.reshape(1, 256).repeat(64, 1)  # [64, 256]
    data = data[:, torch.randperm(256, generator=torch.Generator().manual_seed(1))]
    if columnwise:
        data = data.t().contiguous()  # [256, 64]: every code along M in every column
    m, k = data.shape
    # every byte on CUDA; under the (slow) interpreter both ends and a few ordinary scales,
    # which still cross both formats' short-path bounds (10, 17 and 239, 246)
    values = range(256) if DEVICE.type == "cuda" else [*range(24), 60, 127, 200, *range(232, 256)]
    for value in values:
        scale = torch.full(scale_shape(m, k, columnwise), value, dtype=torch.uint8)
        check_mx(data, scale, dtype, columnwise, f"{dtype} scale {value}")


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
def test_mxfp8_mixed_scales_in_one_tile(dtype, columnwise):
    """Mostly ordinary scales with one extreme block per tile (the general path), and tiles whose
    scales sit exactly at the short path's bounds."""
    m, k = 128, 256
    data = random_bytes((m, k), seed=3)
    fast_min, fast_max = (dequantize.E4M3_DECODE if dtype == E4M3 else dequantize.E5M2_DECODE)[2:]
    for extreme in (0, 1, fast_min - 1, fast_max + 1, 254, 255):
        scale = random_bytes(scale_shape(m, k, columnwise), seed=extreme, low=100, high=150)
        scale.view(-1)[::37] = extreme
        check_mx(data, scale, dtype, columnwise, f"extreme {extreme}")
    for bound in (fast_min, fast_max):
        scale = torch.full(scale_shape(m, k, columnwise), bound, dtype=torch.uint8)
        check_mx(data, scale, dtype, columnwise, f"bound {bound}")


def adversarial(kind, shape=(64, 96)):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen)
    if kind == "zeros":
        x.zero_()
    elif kind == "huge":
        x[1, 5], x[40, 9] = 3.0e38, -1.0e38
    elif kind == "subnormal":
        x *= 1e-39  # E8M0 scales near 0: bf16 subnormal and flushed results
    elif kind == "tiny":
        x *= 2.0**-120  # scales right around the short path's lower bound
    elif kind == "nan":
        x[4, 6] = float("nan")
        x[33, 70] = float("inf")
    elif kind == "spread":
        x *= torch.exp2(torch.randint(-60, 60, (shape[0], 1), generator=gen).float())
    return x


KINDS = ["random", "zeros", "huge", "subnormal", "tiny", "nan", "spread"]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", KINDS)
def test_mxfp8_quantized_tensors(dtype, kind):
    """Both copies of numerics-quantized tensors (what the GEMM sees in training)."""
    x = adversarial(kind)
    buffers = numerics.quantize_mxfp8(x, rowwise=True, columnwise=True, dtype=dtype)
    for columnwise in (False, True):
        prefix = "columnwise" if columnwise else "rowwise"
        data, scale = buffers[f"{prefix}_data"], buffers[f"{prefix}_scale"]
        check_mx(data.view(torch.uint8), scale, dtype, columnwise, f"{kind} {prefix}")


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_rowwise_3d(dtype):
    data = random_bytes((3, 5, 96), seed=5)
    scale = random_bytes((3, 5, 3), seed=6, low=90, high=170)
    check_mx(data, scale, dtype, False, "3d")
    data2 = random_bytes((2, 16, 64), seed=7)  # columnwise: leading dims flatten to M = 32
    scale2 = random_bytes((1, 64), seed=8, low=90, high=170)
    check_mx(data2, scale2, dtype, True, "3d columnwise")


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("block_shape", [(32, 32), (64, 128), (128, 64)])
def test_mxfp8_other_tiles(columnwise, block_shape):
    """The benchmark's tile overrides give the same bits (tile edges not aligned to the shape)."""
    data = random_bytes((160, 224), seed=9)
    scale = random_bytes(scale_shape(160, 224, columnwise), seed=10)
    check_mx(data, scale, E4M3, columnwise, f"tile {block_shape}", block_shape)


def test_mxfp8_columnwise_int32_offset_fallback():
    """A transposed tile whose int32 output offsets would overflow (here forced by a huge tile
    width) takes the untransposed decode plus a torch transpose: same bits."""
    data = random_bytes((64, 96), seed=14).view(E4M3).to(DEVICE)
    scale = random_bytes((2, 96), seed=15).to(DEVICE)
    result = dequantize.dequantize_mxfp8_bf16(data, scale, columnwise=True,
                                              block_shape=(32, 1 << 26))
    assert_bits_equal(result, mx_reference(data, scale, True), "fallback")


def test_mxfp8_empty_and_bad_inputs():
    empty = torch.empty((0, 64), dtype=E4M3, device=DEVICE)
    out = dequantize.dequantize_mxfp8_bf16(empty, torch.empty((0, 2), dtype=torch.uint8,
                                                              device=DEVICE))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float8"):
        dequantize.dequantize_mxfp8_bf16(torch.zeros((32, 32), dtype=torch.uint8, device=DEVICE),
                                         torch.zeros((32, 1), dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="whole 32-blocks"):
        dequantize.dequantize_mxfp8_bf16(
            torch.zeros((32, 32), device=DEVICE).to(E4M3),
            torch.zeros((1, 32), dtype=torch.uint8, device=DEVICE), columnwise=True,
            block_shape=(16, 64))
    with pytest.raises(ValueError, match="out must be"):
        dequantize.dequantize_mxfp8_bf16(
            torch.zeros((32, 32), device=DEVICE).to(E4M3),
            torch.zeros((32, 1), dtype=torch.uint8, device=DEVICE),
            out=torch.empty((32, 32), device=DEVICE))


# ---------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------


def check_nv(data_bytes, scale_bytes, label="", block_shape=None):
    data = data_bytes.to(DEVICE)
    scale = scale_bytes.view(E4M3).to(DEVICE)
    c_bytes = data.shape[-1]
    expected = numerics.dequantize_nvfp4_blocks(
        data.cpu().reshape(-1, c_bytes), scale.cpu().reshape(-1, c_bytes // 8)
    ).reshape(*data.shape[:-1], 2 * c_bytes).to(torch.bfloat16)
    out = poisoned(tuple(expected.shape))
    result = dequantize.dequantize_nvfp4_blocks_bf16(data, scale, out=out,
                                                     block_shape=block_shape)
    assert result.data_ptr() == out.data_ptr()
    assert_bits_equal(result, expected, label)
    assert_bits_equal(dequantize.dequantize_nvfp4_blocks_bf16(data, scale), expected,
                      label + " (fresh)")


def test_nvfp4_every_code_pair_under_every_scale():
    """Every packed byte (all 16 x 16 nibble pairs) under every UE4M3 byte, sign and NaN
    patterns of the scale included."""
    rows = 256
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256).repeat(rows, 1)
    data = torch.stack([row.roll(r) for r, row in enumerate(data)])  # [256, 256] bytes
    scale = (torch.arange(rows * 32, dtype=torch.int32).reshape(rows, 32) % 256).to(torch.uint8)
    check_nv(data, scale, "all codes")


@pytest.mark.parametrize("shape", [(16, 8), (48, 24), (80, 200), (33, 72)])
def test_nvfp4_random(shape):
    r, c_bytes = shape
    data = random_bytes((r, c_bytes), seed=r + c_bytes)
    scale = random_bytes((r, c_bytes // 8), seed=r * c_bytes)
    check_nv(data, scale, f"{shape}")


@pytest.mark.parametrize("kind", KINDS + ["fp4"])
@pytest.mark.parametrize("two_dimensional", [False, True], ids=["1d", "2d"])
def test_nvfp4_quantized_tensors(kind, two_dimensional):
    x = adversarial("random", (64, 96)) * 3.0 if kind == "fp4" else adversarial(kind, (64, 96))
    buffers = numerics.quantize_nvfp4(x, rowwise=True, columnwise=True,
                                      two_dimensional=two_dimensional)
    for prefix in ("rowwise", "columnwise"):
        data, scale = buffers[f"{prefix}_data"], buffers[f"{prefix}_scale"]
        check_nv(data, scale.view(torch.uint8), f"{kind} {prefix}")


def test_nvfp4_3d_and_tiles():
    data = random_bytes((2, 7, 40), seed=12)
    scale = random_bytes((2, 7, 5), seed=13)
    check_nv(data, scale, "3d")
    for block_shape in ((16, 32), (64, 64), (8, 256)):
        check_nv(data, scale, f"tile {block_shape}", block_shape)


# ---------------------------------------------------------------------------------------------
# the storages' GEMM operands
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_gemm_operand_is_bf16_kernel_output(dtype):
    x = adversarial("spread", (64, 96)).to(DEVICE)
    storage = as_storage(mf.MXFP8Quantizer(dtype)(x))
    for columnwise in (False, True):
        values, alpha = storage.gemm_operand(columnwise)
        assert alpha is None
        data = storage.columnwise_data if columnwise else storage.rowwise_data
        scale = storage.columnwise_scale if columnwise else storage.rowwise_scale
        assert_bits_equal(values, mx_reference(data, scale, columnwise), f"operand {columnwise}")


@pytest.mark.parametrize("two_dimensional", [False, True], ids=["1d", "2d"])
def test_nvfp4_gemm_operand_is_bf16_kernel_output(two_dimensional):
    x = adversarial("spread", (64, 96)).to(DEVICE)
    quantizer = mf.NVFP4Quantizer(with_2d_quantization=two_dimensional)
    storage = as_storage(quantizer(x))
    for columnwise in (False, True):
        values, alpha = storage.gemm_operand(columnwise)
        prefix = "columnwise" if columnwise else "rowwise"
        data = getattr(storage, f"{prefix}_data").cpu()
        scale = getattr(storage, f"{prefix}_scale").cpu()
        amax = getattr(storage, f"amax_{prefix}").cpu()
        expected = numerics.dequantize_nvfp4_blocks(data, scale).to(torch.bfloat16)
        assert_bits_equal(values, expected, prefix)
        torch.testing.assert_close(alpha.cpu(), numerics.global_decode_scale(amax), rtol=0,
                                   atol=0)


@pytest.mark.parametrize("amax", [0.0, 2.0**-149, 1e-30, 0.37, 2688.0, 3e38, float("inf"),
                                  float("nan")])
def test_nvfp4_operand_decode_scale_is_the_references(amax):
    """S_dec from the decode's own launch equals numerics.global_decode_scale bit for bit, at
    the rule's edges (0 and inf give S_enc 1; a tiny amax caps S_enc at FLT_MAX; NaN stays)."""
    data = random_bytes((32, 48), seed=5).to(DEVICE)
    scale = random_bytes((32, 6), seed=6, high=0x7F).view(E4M3).to(DEVICE)
    amax_tensor = torch.tensor([amax], device=DEVICE)
    values, s_dec = dequantize.dequantize_nvfp4_operand(data, scale, amax_tensor)
    assert_bits_equal(values, numerics.dequantize_nvfp4_blocks(data.cpu(), scale.cpu()), "values")
    expected = numerics.global_decode_scale(amax_tensor.cpu())
    assert s_dec.shape == expected.shape and s_dec.dtype == torch.float32
    assert s_dec.cpu().view(torch.int32).tolist() == expected.view(torch.int32).tolist() or (
        s_dec.isnan().all() and expected.isnan().all()), (s_dec, expected)


def test_nvfp4_operand_of_an_empty_copy_still_gives_its_decode_scale():
    data = torch.empty((0, 8), dtype=torch.uint8, device=DEVICE)
    scale = torch.empty((0, 1), dtype=torch.uint8, device=DEVICE)
    values, s_dec = dequantize.dequantize_nvfp4_operand(data, scale,
                                                        torch.tensor([6.0], device=DEVICE))
    assert values.shape == (0, 16)
    assert s_dec.item() == numerics.global_decode_scale(torch.tensor([6.0])).item()
