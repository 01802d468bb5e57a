"""Triton FP8 kernels (per-tensor, block 1D/2D, multi-tensor) equal the numerics reference byte
for byte: data, transpose and scales, for fresh random inputs of every input dtype and for
adversarial ones (zeros, a huge value, ties, subnormals, +-max, inf, NaN, ragged shapes, 3D).

Runs on CUDA when available; otherwise on CPU through Triton's interpreter when TRITON_INTERPRET=1
and Triton is installed; skipped elsewhere. The reference always runs on CPU (the spec); kernel
outputs are moved there for comparison. Interpreter runs keep shapes small.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gpu.fp8_codes import canonical_nan

if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
elif os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    DEVICE = torch.device("cpu")
else:
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 with triton installed", allow_module_level=True)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import minifloat as mf  # noqa: E402
from minifloat import numerics  # noqa: E402
from minifloat.kernels import amax as amax_kernel  # noqa: E402
from minifloat.kernels import block_fp8, fp8_common, multi_tensor, per_tensor_fp8  # noqa: E402
from minifloat.kernels.fp8_common import reciprocal_rn, sat_rne_fp8, scale_from_amax  # noqa: E402

# numpy warns when the interpreter divides fp8_max by a tiny amax; the inf is the tested case
pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# Ragged shapes (K of 1, 17, 130, 257; odd M), 3D, and aligned ones. The interpreter runs every
# program in Python, so larger shapes run on CUDA only.
SHAPES = [(1, 1), (3, 5), (17, 130), (130, 17), (1, 257), (2, 3, 257), (256, 128)]
if DEVICE.type == "cuda":
    SHAPES += [(257, 1), (200, 300), (1024, 2048), (4, 1000, 1536)]
USAGES = [(True, True), (True, False), (False, True)]
USAGE_IDS = ["both", "rowwise", "columnwise"]
KINDS = ["zeros", "huge", "ties", "subnormal", "max", "inf", "nan"]
# adversarial shapes: aligned (every 128-block anchored at 448, see adversarial_input) + ragged
ADVERSARIAL_SHAPES = [(128, 256), (17, 130)]
if DEVICE.type == "cuda":
    ADVERSARIAL_SHAPES += [(512, 384), (130, 257)]


@pytest.fixture(params=[DEVICE], ids=[DEVICE.type])
def device(request):
    return request.param


# ---------------------------------------------------------------------------------------------
# inputs and comparisons
# ---------------------------------------------------------------------------------------------


def random_input(shape, dtype, seed):
    """Normal values with magnitudes spread over 2^-12..2^12 across rows and columns, so blocks
    get different scales and some elements land in the FP8 subnormal range."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).reshape(-1, shape[-1])
    m, k = x.shape
    x = x * torch.logspace(-6, 6, m, base=2.0)[:, None] * torch.logspace(6, -6, k, base=2.0)
    return x.reshape(shape).to(dtype)


def _midpoints(dtype):
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    return (grid[1:] + grid[:-1]) / 2


def adversarial_input(kind, shape, dtype):
    """Adversarial values; with 'ties' and 'max' every 128-block of either direction holds 448,
    so block and E4M3 per-tensor scales are 1 and the midpoints stay midpoints after scaling."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7)).reshape(-1, shape[-1])
    m, k = x.shape
    rows = torch.arange(m)[:, None]
    cols = torch.arange(k)[None, :]
    anchor = (rows + cols) % 128 == 0
    flat = x.view(-1)
    if kind == "zeros":
        x.zero_()
        flat[::3] = -0.0
    elif kind == "huge":
        flat[min(17, flat.numel() - 1)] = 3e38
    elif kind == "ties":
        ties = torch.cat([_midpoints(E4M3), _midpoints(E5M2) / 128])
        ties = torch.cat([ties, -ties])
        x = ties.repeat(cdiv(m * k, ties.numel()))[: m * k].reshape(m, k)
        x[anchor] = 448.0
    elif kind == "subnormal":
        x = x * 1e-39 if dtype == torch.float32 else x * 2.0**-20
        flat = x.view(-1)
        flat[::5] = 2.0**-9 * 1.5  # E4M3 subnormal tie region
    elif kind == "max":
        finfo = torch.finfo(dtype)
        values = torch.tensor([448.0, -448.0, 57344.0, -57344.0, 464.0, -479.0, finfo.max,
                               -finfo.max, finfo.tiny, -finfo.tiny])
        flat[: min(values.numel(), flat.numel())] = values[: flat.numel()]
        x[anchor] = 448.0
    elif kind == "inf":
        flat[::7] = float("inf")
        flat[3::11] = -float("inf")
    elif kind == "nan":
        flat[::13] = float("nan")
        flat[5::17] = -float("nan")
    return x.reshape(shape).to(dtype)


def cdiv(a, b):
    return -(-a // b)


def as_bytes(t):
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # standard strides
    return dense.view(torch.uint8).reshape(-1)


def assert_bytes_equal(actual, expected, what, *, fp8_dtype=None):
    assert actual is not None, f"{what}: missing"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, b = as_bytes(actual), as_bytes(expected)
    if fp8_dtype is not None:
        a, b = canonical_nan(a, fp8_dtype), canonical_nan(b, fp8_dtype)
    bad = (a != b).nonzero().reshape(-1)
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at byte {bad[:5].tolist()}: "
        f"{a[bad[:5]].tolist()} != {b[bad[:5]].tolist()}"
    )


def assert_same_amax(actual, expected, what="amax"):
    actual, expected = actual.detach().cpu().float(), expected.detach().cpu().float()
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN differs"
    keep = ~expected.isnan()
    assert torch.equal(actual[keep].view(torch.int32), expected[keep].view(torch.int32)), what


# ---------------------------------------------------------------------------------------------
# device functions: rounding, scales, reciprocal
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_kernel(y_ptr, e4m3_ptr, e5m2_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(e4m3_ptr + offsets, sat_rne_fp8(y, False), mask=mask)
    tl.store(e5m2_ptr + offsets, sat_rne_fp8(y, True), mask=mask)


@triton.jit
def _round_hw_kernel(y_ptr, e4m3_ptr, e5m2_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(e4m3_ptr + offsets, fp8_common.fp8_codes(y, False, True), mask=mask)
    tl.store(e5m2_ptr + offsets, fp8_common.fp8_codes(y, True, True), mask=mask)


@triton.jit
def _scale_kernel(amax_ptr, scale_ptr, scale_inv_ptr, n, eps, E5M2: tl.constexpr,
                  POW2: tl.constexpr, OVERFLOW_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = scale_from_amax(tl.load(amax_ptr + offsets, mask=mask), eps, E5M2, POW2,
                            OVERFLOW_BITS)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(scale_inv_ptr + offsets, reciprocal_rn(scale), mask=mask)


def _fp32_patterns():
    gen = torch.Generator().manual_seed(3)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (60000,), generator=gen, dtype=torch.int64)
    spread = torch.randn(60000, generator=gen) * torch.logspace(-30, 20, 60000, base=2.0)
    grids = []
    for dtype in (E4M3, E5M2):
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[torch.isfinite(grid)]
        mids = _midpoints(dtype)
        grids += [grid, mids, -mids, torch.nextafter(mids, torch.full_like(mids, 1e30)),
                  torch.nextafter(mids, torch.zeros_like(mids))]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            464.0, 479.99, 480.0, 61439.0, 61440.0, 3.4e38, 1e-45, -1e-45,
                            2.0**-126, 2.0**-127, 2.0**-10, 2.0**-17])
    return torch.cat([random_bits.to(torch.int32).view(torch.float32), spread, *grids, special])


def test_rounding_matches_cast_to_fp8(device):
    y = _fp32_patterns()
    n = y.numel()
    e4m3 = torch.empty(n, dtype=torch.uint8, device=device)
    e5m2 = torch.empty(n, dtype=torch.uint8, device=device)
    _round_kernel[(cdiv(n, 4096),)](y.to(device), e4m3, e5m2, n, BLOCK=4096)
    assert_bytes_equal(e4m3.view(E4M3), numerics.cast_to_fp8(y, E4M3), "E4M3", fp8_dtype=E4M3)
    assert_bytes_equal(e5m2.view(E5M2), numerics.cast_to_fp8(y, E5M2), "E5M2", fp8_dtype=E5M2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the hardware cast is CUDA-only (inline PTX)")
def test_hardware_rounding_matches_cast_to_fp8(device):
    """The cvt.rn.satfinite path the kernels take on CUDA gives the reference bytes for every
    pattern of the integer-rounding test (midpoints, subnormals, saturation, inf, NaN)."""
    if not fp8_common.hw_cast(torch.empty(1, device=device)):
        pytest.skip("no hardware FP8 conversion on this device")
    y = _fp32_patterns()
    n = y.numel()
    e4m3 = torch.empty(n, dtype=torch.uint8, device=device)
    e5m2 = torch.empty(n, dtype=torch.uint8, device=device)
    _round_hw_kernel[(cdiv(n, 4096),)](y.to(device), e4m3, e5m2, n, BLOCK=4096)
    assert_bytes_equal(e4m3.view(E4M3), numerics.cast_to_fp8(y, E4M3), "E4M3", fp8_dtype=E4M3)
    assert_bytes_equal(e5m2.view(E5M2), numerics.cast_to_fp8(y, E5M2), "E5M2", fp8_dtype=E5M2)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2_scale", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("overflow", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["flt_max", "bf16_max", "fp16_max"])
def test_scale_and_reciprocal_match_reference(device, fp8_dtype, power_2_scale, amax_epsilon,
                                              overflow):
    amax = torch.cat([_fp32_patterns().abs()[::7], torch.tensor(
        [0.0, 1e-40, 1e-38, 1e-36, 1.3e-36, 5.3e-36, 2e-36, 1.0, 448.0, 3e38, float("inf"),
         float("nan")])])
    n = amax.numel()
    scale = torch.empty(n, device=device)
    scale_inv = torch.empty(n, device=device)
    overflow_value = float(torch.finfo(overflow).max)
    _scale_kernel[(cdiv(n, 4096),)](
        amax.to(device), scale, scale_inv, n, fp8_common.float32_value(amax_epsilon),
        E5M2=fp8_dtype == E5M2, POW2=power_2_scale, OVERFLOW_BITS=fp8_common.float32_bits(
            overflow_value), BLOCK=4096)
    expected = numerics.scale_from_amax(
        amax, numerics.fp8_format(fp8_dtype).max_value, amax_epsilon=amax_epsilon,
        power_2_scale=power_2_scale, overflow_value=overflow_value)
    assert_bytes_equal(scale, expected, "scale")
    assert_bytes_equal(scale_inv, torch.reciprocal(expected), "scale_inv")


# ---------------------------------------------------------------------------------------------
# amax
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (300, 300), (2, 3, 257)])
def test_amax(device, shape, dtype):
    x = random_input(shape, dtype, seed=1)
    assert_same_amax(amax_kernel.compute_amax(x.to(device)), numerics.compute_amax(x))
    for kind in ("zeros", "huge", "inf", "nan", "subnormal"):
        x = adversarial_input(kind, shape, dtype)
        assert_same_amax(amax_kernel.compute_amax(x.to(device)), numerics.compute_amax(x), kind)


def test_amax_folds_into_out(device):
    x = random_input((40, 50), torch.bfloat16, seed=2)
    out = torch.full((1,), 1e6, device=device)
    assert amax_kernel.compute_amax(x.to(device), out) is out
    assert out.item() == 1e6
    out.fill_(0.25)
    amax_kernel.compute_amax(x.to(device), out)
    assert_same_amax(out, numerics.compute_amax(x).reshape(1))
    with pytest.raises(ValueError, match="non-empty contiguous"):
        amax_kernel.compute_amax(torch.empty(0, 4, device=device))


# ---------------------------------------------------------------------------------------------
# per-tensor FP8
# ---------------------------------------------------------------------------------------------


def check_per_tensor(result, data, scale_inv, shape, usage, fp8_dtype, what):
    kernel_data, kernel_t, kernel_scale_inv = result
    expected = data.reshape(torch.Size(shape)[:-1].numel(), shape[-1])
    if usage[0]:
        assert_bytes_equal(kernel_data, expected, f"{what} data", fp8_dtype=fp8_dtype)
    else:
        assert kernel_data is None
    if usage[1]:
        assert_bytes_equal(kernel_t, expected.t(), f"{what} transpose", fp8_dtype=fp8_dtype)
    else:
        assert kernel_t is None
    # bitwise, but a NaN scale_inv (from a NaN delayed scale) only as NaN: its payload is the
    # arithmetic's (CUDA canonical, the CPU's the operand's) and no part of the contract
    assert kernel_scale_inv.shape == (1,) and kernel_scale_inv.dtype == torch.float32, what
    assert_same_amax(kernel_scale_inv, scale_inv.reshape(1), f"{what} scale_inv")


def run_current(x, device, fp8_dtype, usage, **options):
    """x may already be on the device: a view there keeps its offset (its alignment)."""
    result = per_tensor_fp8.quantize_current_scaling(
        x.to(device), fp8_dtype, rowwise=usage[0], columnwise=usage[1], **options)
    data, scale_inv = numerics.quantize_current_scaling(x.cpu(), fp8_dtype, **options)
    check_per_tensor(result, data, scale_inv, x.shape, usage, fp8_dtype, "current")


def run_delayed(x, device, fp8_dtype, usage, scale_value, amax_value=0.5):
    scale = torch.tensor([scale_value], device=device)
    amax = torch.tensor([amax_value], device=device)
    result = per_tensor_fp8.quantize_delayed_scaling(
        x.to(device), scale, amax, fp8_dtype, rowwise=usage[0], columnwise=usage[1])
    data, scale_inv = numerics.quantize_with_scale(x, scale.cpu(), fp8_dtype)
    check_per_tensor(result, data, scale_inv, x.shape, usage, fp8_dtype, "delayed")
    reference_amax = torch.maximum(torch.tensor([amax_value]), numerics.compute_amax(x))
    assert_same_amax(amax, reference_amax, "delayed amax")


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_per_tensor_random(device, shape, dtype):
    x = random_input(shape, dtype, seed=sum(shape))
    run_current(x, device, E4M3, (True, True))
    run_current(x, device, E5M2, (True, True))
    run_current(x, device, E4M3, (True, False), power_2_scale=True, amax_epsilon=1e-3)
    run_current(x, device, E5M2, (False, True), amax_epsilon=1e4)
    run_delayed(x, device, E4M3, (True, True), scale_value=3.7)
    run_delayed(x, device, E5M2, (False, True), scale_value=2.0**20, amax_value=1e9)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_per_tensor_adversarial(device, kind, dtype):
    for shape in ADVERSARIAL_SHAPES:
        x = adversarial_input(kind, shape, dtype)
        run_current(x, device, E4M3, (True, True))
        run_current(x, device, E5M2, (True, True), power_2_scale=True)
        run_delayed(x, device, E4M3 if shape[0] % 2 else E5M2, (True, True), scale_value=1.0)
    run_delayed(adversarial_input(kind, (3, 5), dtype), device, E4M3, (True, True),
                scale_value=1e-30, amax_value=float("nan") if kind == "zeros" else 0.0)


def test_per_tensor_given_amax(device):
    x = random_input((33, 65), torch.bfloat16, seed=4)
    for value in (0.0, 1e-40, 5e-37, 100.0, float("inf"), float("nan")):
        amax = torch.tensor([value])
        result = per_tensor_fp8.quantize_current_scaling(x.to(device), E4M3, amax=amax.to(device))
        data, scale_inv = numerics.quantize_current_scaling(x, E4M3, amax=amax)
        check_per_tensor(result, data, scale_inv, x.shape, (True, True), E4M3, f"amax={value}")


def _specials(shape, dtype, seed):
    """NaN of both signs, infinities, a huge value, subnormal-range and zero runs, in the first
    tile only, so other tiles take the NaN-free path of the tile."""
    x = random_input(shape, torch.float32, seed)
    m, k = x.shape
    x[0, 1] = float("nan")
    x[min(3, m - 1), 2] = -float("nan")
    x[min(2, m - 1), 3] = float("inf")
    x[1 % m, 0] = -float("inf")
    x[min(5, m - 1), min(6, k - 1)] = 3e38
    x[-1, :4] = torch.tensor([2.0**-133, -(2.0**-130), 0.0, -0.0])[: min(4, k)]
    return x.to(dtype)


def _check_nan_codes(result, x, scale, usage, fp8_dtype, what):
    """The contract's NaN code, 0x7F | sign(y), for every NaN product y = x * scale, with the
    signs of products computed on the device by torch (CUDA returns the canonical NaN, the
    interpreter's numpy keeps the input's sign): check_per_tensor compares NaN codes up to
    their sign, this checks the sign."""
    products = (x.to(DEVICE).float().reshape(-1, x.shape[-1]) * scale.to(DEVICE)).cpu()
    nan = products.isnan()
    expected = (0x7F | ((products.view(torch.int32) >> 24) & 0x80)).to(torch.uint8)
    copies = [(result[0], nan, expected)] if usage[0] else []
    if usage[1]:
        copies.append((result[1], nan.t(), expected.t()))
    for codes, where, want in copies:
        got = codes.cpu().view(torch.uint8)
        assert torch.equal(got[where], want[where]), f"{what}: NaN codes"


@pytest.mark.parametrize("emulate", [False, True], ids=["int", "products"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(32, 64), (36, 68), (12, 100), (64, 40), (18, 66), (7, 37)])
def test_per_tensor_tile_modes(device, shape, dtype, emulate, monkeypatch):
    """per_tensor_tile in every mode its host picks (int64 words of bf16 or element loads,
    word or byte stores of either copy, masks), with small tiles so that shapes cover whole
    tiles, ragged last tiles in M and in K and several tiles: each usage, both formats,
    delayed / current / given amax, against the reference byte for byte (the NaN sign
    included: _check_nan_codes), and the delayed amax. `products` runs the CUDA algorithm
    under the interpreter (per-tile NaN fix-up over a cvt stand-in that writes a wrong NaN
    byte); on CUDA both ids run the hardware path."""
    for name in ("TILE_M", "BYTES_TILE_M"):
        monkeypatch.setattr(per_tensor_fp8, name, 16)
    for name in ("TILE_K", "BYTES_TILE_K"):
        monkeypatch.setattr(per_tensor_fp8, name, 32)
    monkeypatch.setattr(per_tensor_fp8, "EMULATE_PRODUCTS", emulate)
    x = _specials(shape, dtype, seed=sum(shape))
    m, k = shape
    modes = per_tensor_fp8.tile_modes(x.to(DEVICE), m, k, 16, 32)
    assert modes["HALVES"] == (dtype == torch.bfloat16 and k % 4 == 0)
    assert (modes["ROW_WORDS"], modes["COL_WORDS"]) == (k % 4 == 0, m % 4 == 0)
    cases = [(E4M3, (True, True), "delayed"), (E5M2, (True, True), "current"),
             (E4M3, (True, False), "current"), (E5M2, (False, True), "delayed"),
             (E4M3, (True, True), "given"), (E5M2, (True, True), "delayed")]
    for fp8_dtype, usage, mode in cases:
        what = f"{shape} {dtype} {fp8_dtype} {usage} {mode}"
        if mode == "delayed":
            scale, amax = torch.tensor([3.5]), torch.tensor([0.25], device=DEVICE)
            result = per_tensor_fp8.quantize_delayed_scaling(
                x.to(DEVICE), scale.to(DEVICE), amax, fp8_dtype, rowwise=usage[0],
                columnwise=usage[1])
            data, scale_inv = numerics.quantize_with_scale(x, scale, fp8_dtype)
            reference_amax = torch.maximum(torch.tensor([0.25]), numerics.compute_amax(x))
            assert_same_amax(amax, reference_amax, f"{what} amax")
        else:
            given = torch.tensor([100.0]) if mode == "given" else None
            result = per_tensor_fp8.quantize_current_scaling(
                x.to(DEVICE), fp8_dtype, amax=None if given is None else given.to(DEVICE),
                rowwise=usage[0], columnwise=usage[1])
            data, scale_inv = numerics.quantize_current_scaling(x, fp8_dtype, amax=given)
            scale = torch.reciprocal(scale_inv.reshape(1))
        check_per_tensor(result, data, scale_inv, shape, usage, fp8_dtype, what)
        _check_nan_codes(result, x, scale, usage, fp8_dtype, what)


@pytest.mark.parametrize("emulate", [False, True], ids=["int", "products"])
@pytest.mark.parametrize("scale_value", [0.0, float("inf"), float("nan")], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_per_tensor_special_scales(device, scale_value, dtype, emulate, monkeypatch):
    """Delayed scales that make NaN products out of finite inputs (0 * inf, NaN scale) take
    the NaN fix-up in every tile: the contract's NaN codes, the reference's other bytes."""
    monkeypatch.setattr(per_tensor_fp8, "TILE_M", 16)
    monkeypatch.setattr(per_tensor_fp8, "TILE_K", 32)
    monkeypatch.setattr(per_tensor_fp8, "EMULATE_PRODUCTS", emulate)
    x = random_input((20, 40), dtype, seed=9)
    x[0, :3] = torch.tensor([0.0, float("inf"), -float("inf")])
    scale = torch.tensor([scale_value])
    result = per_tensor_fp8.quantize_delayed_scaling(
        x.to(DEVICE), scale.to(DEVICE), torch.zeros(1, device=DEVICE), E4M3)
    data, scale_inv = numerics.quantize_with_scale(x, scale, E4M3)
    check_per_tensor(result, data, scale_inv, x.shape, (True, True), E4M3, str(scale_value))
    _check_nan_codes(result, x, scale, (True, True), E4M3, str(scale_value))


def test_per_tensor_tile_mode_choice(device):
    """What the host reads as words: bf16 rows of whole words at 8-byte aligned addresses only
    (K % 4 != 0, other dtypes and a view 4-byte aligned load elements); word stores where the
    copy's rows are whole words. Each such input still gives the reference's bytes."""
    x = random_input((8, 40), torch.bfloat16, seed=3).to(DEVICE)
    assert per_tensor_fp8.tile_modes(x, 8, 40, 64, 128)["HALVES"]
    assert not per_tensor_fp8.tile_modes(x[:, :38].contiguous(), 8, 38, 64, 128)["HALVES"]
    assert not per_tensor_fp8.tile_modes(x.float(), 8, 40, 64, 128)["HALVES"]
    shifted = x.flatten()[2:2 + 7 * 40].view(7, 40)  # 4-byte aligned, not 8
    modes = per_tensor_fp8.tile_modes(shifted, 7, 40, 64, 128)
    assert not modes["HALVES"] and modes["ROW_WORDS"] and not modes["COL_WORDS"]
    run_current(shifted, device, E4M3, (True, True))  # the unaligned view itself
    run_current(random_input((6, 38), torch.bfloat16, seed=4), device, E4M3, (True, True))
    run_delayed(random_input((6, 40), torch.bfloat16, seed=5), device, E5M2, (True, True), 2.0)
    run_delayed(random_input((6, 40), torch.bfloat16, seed=5), device, E5M2, (True, False), 2.0)


# ---------------------------------------------------------------------------------------------
# block FP8
# ---------------------------------------------------------------------------------------------


def check_block(result, x, dim, usage, what, **options):
    if dim == 1:
        expected = (*numerics.quantize_block_1d(x, **options),
                    *numerics.quantize_block_1d_columnwise(x, **options))
    else:
        data, scale_inv = numerics.quantize_block_2d(x, **options)
        expected = (data, scale_inv, *numerics.transpose_block_2d(data, scale_inv))
    names = ("rowwise data", "rowwise scale_inv", "columnwise data", "columnwise scale_inv")
    wanted = (usage[0], usage[0], usage[1], usage[1])
    for got, ref, name, want in zip(result, expected, names, wanted, strict=True):
        if want:
            fp8_dtype = E4M3 if "data" in name else None
            assert_bytes_equal(got, ref, f"{what} {name}", fp8_dtype=fp8_dtype)
        else:
            assert got is None, f"{what} {name} was not asked for"


def run_block(x, device, dim, usage, **options):
    quantize = block_fp8.quantize_block_1d if dim == 1 else block_fp8.quantize_block_2d
    result = quantize(x.to(device), rowwise=usage[0], columnwise=usage[1], **options)
    check_block(result, x, dim, usage, f"{dim}D", **options)


@pytest.mark.parametrize("dim", [1, 2], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_random(device, shape, dtype, dim):
    x = random_input(shape, dtype, seed=sum(shape) + dim)
    for usage in USAGES:
        run_block(x, device, dim, usage)
    run_block(x, device, dim, (True, True), power_2_scale=False, amax_epsilon=1e-3)


@pytest.mark.parametrize("dim", [1, 2], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_block_adversarial(device, kind, dtype, dim):
    for shape in ADVERSARIAL_SHAPES:
        x = adversarial_input(kind, shape, dtype)
        run_block(x, device, dim, (True, True), power_2_scale=shape[0] % 2 == 0)


def test_wide_offsets_path(device, monkeypatch):
    """The 64-bit in-tile offsets (tensors with 128 * max(M, K) >= 2^31) give the same bytes;
    forced on small shapes, since such tensors are too large for the interpreter."""
    monkeypatch.setattr(per_tensor_fp8, "needs_wide_offsets", lambda *args: True)
    monkeypatch.setattr(block_fp8, "needs_wide_offsets", lambda *args: True)
    x = random_input((130, 257), torch.bfloat16, seed=5)
    run_current(x, device, E4M3, (True, True))
    run_delayed(x, device, E5M2, (True, True), scale_value=3.0)
    for dim in (1, 2):
        run_block(x, device, dim, (True, True))


# ---------------------------------------------------------------------------------------------
# multi-tensor
# ---------------------------------------------------------------------------------------------

MULTI_SHAPES = [(3, 5), (130, 17), (0, 16), (1, 257), (2, 3, 40), (64, 64), (5, 0)]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
def test_multi_tensor_per_tensor(device, dtype, fp8_dtype):
    xs = [random_input(s, dtype, seed=i) if 0 not in s else torch.zeros(s, dtype=dtype)
          for i, s in enumerate(MULTI_SHAPES)]
    xs[1] = adversarial_input("nan", (130, 17), dtype)
    for usage in USAGES:
        results = multi_tensor.quantize_current_scaling_multi(
            [x.to(device) for x in xs], fp8_dtype, rowwise=usage[0], columnwise=usage[1],
            power_2_scale=usage == (True, False))
        for x, result in zip(xs, results, strict=True):
            data, scale_inv = numerics.quantize_current_scaling(
                x, fp8_dtype, power_2_scale=usage == (True, False))
            check_per_tensor(result, data, scale_inv, x.shape, usage, fp8_dtype, f"{x.shape}")
    floor = torch.tensor(100.0, device=device)
    results = multi_tensor.quantize_current_scaling_multi(
        [x.to(device) for x in xs], fp8_dtype, reduce_amax=lambda a: torch.maximum(a, floor))
    for x, result in zip(xs, results, strict=True):
        amax = torch.maximum(numerics.compute_amax(x), torch.tensor(100.0))
        data, scale_inv = numerics.quantize_current_scaling(x, fp8_dtype, amax=amax)
        check_per_tensor(result, data, scale_inv, x.shape, (True, True), fp8_dtype, "reduced")


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=DTYPE_IDS)
def test_multi_tensor_block_1d(device, dtype):
    xs = [random_input(s, dtype, seed=10 + i) if 0 not in s else torch.zeros(s, dtype=dtype)
          for i, s in enumerate(MULTI_SHAPES)]
    xs[5] = adversarial_input("inf", (64, 64), dtype)
    for usage in USAGES:
        results = multi_tensor.quantize_block_1d_multi(
            [x.to(device) for x in xs], rowwise=usage[0], columnwise=usage[1])
        for x, result in zip(xs, results, strict=True):
            if x.numel():
                check_block(result, x, 1, usage, f"multi {tuple(x.shape)}")
                continue
            m, k = torch.Size(x.shape)[:-1].numel(), x.shape[-1]  # empty: shapes only
            shapes = [(m, k), (m, cdiv(k, 128)), (k, m), (k, cdiv(m, 128))]
            for got, want, shape in zip(result, (*[usage[0]] * 2, *[usage[1]] * 2), shapes,
                                        strict=True):
                assert (got is not None) == want
                assert got is None or tuple(got.shape) == shape


def test_multi_tensor_rejects_mixed_inputs(device):
    a = torch.zeros(4, 4, device=device)
    with pytest.raises(ValueError, match="one dtype"):
        multi_tensor.quantize_current_scaling_multi([a, a.to(torch.bfloat16)], E4M3)
    with pytest.raises(ValueError, match="at least one"):
        multi_tensor.quantize_block_1d_multi([])


# ---------------------------------------------------------------------------------------------
# quantizers dispatch to the kernels
# ---------------------------------------------------------------------------------------------

QUANTIZERS = {  # internal=True: quantize() returns the storage itself
    "current_e4m3": lambda d, u: mf.Float8CurrentScalingQuantizer(
        E4M3, rowwise=u[0], columnwise=u[1], internal=True),
    "current_e5m2_pow2": lambda d, u: mf.Float8CurrentScalingQuantizer(
        E5M2, power_2_scale=True, amax_epsilon=1e-3, rowwise=u[0], columnwise=u[1],
        internal=True),
    "delayed_e4m3": lambda d, u: mf.Float8Quantizer(
        torch.tensor([16.0], device=d), torch.zeros(1, device=d), E4M3, rowwise=u[0],
        columnwise=u[1], internal=True),
    "block_1d": lambda d, u: mf.Float8BlockQuantizer(1, rowwise=u[0], columnwise=u[1],
                                                     internal=True),
    "block_2d": lambda d, u: mf.Float8BlockQuantizer(2, rowwise=u[0], columnwise=u[1],
                                                     internal=True),
}
KERNEL_ENTRY = {"current": (per_tensor_fp8, "quantize_current_scaling"),
                "delayed": (per_tensor_fp8, "quantize_delayed_scaling"),
                "block": (block_fp8, None)}


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantizer_uses_kernel_and_matches_reference(device, name, usage, monkeypatch):
    x = random_input((3, 40, 72), torch.bfloat16, seed=6)
    calls = []
    module, entry = KERNEL_ENTRY[name.split("_")[0]]
    for attr in [entry] if entry else ["quantize_block_1d", "quantize_block_2d"]:
        original = getattr(module, attr)

        def spy(*args, _original=original, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, spy)
    quantizer = QUANTIZERS[name](device, usage)
    fast = quantizer.quantize(x.to(device))
    assert calls, f"{name} did not run a kernel"
    monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", "1")
    reference = QUANTIZERS[name]("cpu", usage).quantize(x)
    for field in reference.tensor_fields():
        ref = getattr(reference, field)
        got = getattr(fast, field)
        assert (got is None) == (ref is None), field
        if ref is not None:
            assert_bytes_equal(got, ref, f"{name} {field}")
    assert torch.equal(fast.dequantize().cpu(), reference.dequantize())
    if name.startswith("delayed"):
        assert_same_amax(quantizer.amax, numerics.compute_amax(x).reshape(1))


def test_quantizer_falls_back_for_non_contiguous(device, monkeypatch):
    monkeypatch.setattr(per_tensor_fp8, "quantize_current_scaling", None)  # must not be called
    x = random_input((40, 72), torch.float32, seed=8).to(device).t()
    fast = mf.Float8CurrentScalingQuantizer(E4M3, internal=True).quantize(x)
    data, _ = numerics.quantize_current_scaling(x.cpu(), E4M3)
    assert_bytes_equal(fast.data, data.reshape(-1, x.shape[-1]), "non-contiguous")
