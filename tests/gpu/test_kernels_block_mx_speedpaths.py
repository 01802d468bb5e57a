"""The faster code paths of the block-FP8 and MXFP8 kernels equal the numerics reference byte for
byte in every configuration they can be launched with, not only the default one:

- block FP8: the division-free power-of-two scale and its reciprocal (pow2_scale,
  pow2_reciprocal) on every class of amax bit pattern; the one kernel in each of its modes (bf16
  read as words or any dtype read as elements; each copy stored as whole words or byte by byte)
  over shapes with partial tiles in either direction, 3D inputs, unaligned views, forced 64-bit
  offsets and other warp counts, and adversarial values (NaN, inf, subnormals, +-max, zeros,
  ties);
- MXFP8: the direct (reshape-free) columnwise path and the reshaped one over several tile
  shapes (K not a multiple of the tile, several 32-row blocks per tile), both directions alone
  and together.

Runs on CUDA, or on CPU through Triton's interpreter (TRITON_INTERPRET=1); skipped elsewhere.
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

from minifloat import numerics  # noqa: E402
from minifloat.kernels import block_fp8, fp8_common  # noqa: E402
from minifloat.kernels import mxfp8 as mxfp8_kernels  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = torch.finfo(torch.float32).max
CUDA = DEVICE.type == "cuda"


def as_bytes(t):
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # standard strides
    return dense.view(torch.uint8).reshape(-1)


def assert_bytes_equal(actual, expected, what, fp8_dtype=None):
    assert actual is not None, f"{what}: missing"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}"
    a, b = as_bytes(actual), as_bytes(expected)
    if fp8_dtype is not None:
        a, b = canonical_nan(a, fp8_dtype), canonical_nan(b, fp8_dtype)
    bad = (a != b).nonzero().reshape(-1)
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at "
                              f"{bad[:5].tolist()}: {a[bad[:5]].tolist()} != {b[bad[:5]].tolist()}")


def hard_input(shape, kind, dtype, seed=0):
    """Rows and columns of very different magnitudes, with one hard case planted."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).reshape(-1, shape[-1])
    m, k = x.shape
    x = x * torch.exp2(torch.randint(-12, 13, (m, 1), generator=gen).float())
    x = x * torch.exp2(torch.randint(-6, 7, (1, k), generator=gen).float())
    flat = x.view(-1)
    if kind == "nan":
        flat[::37] = float("nan")
        flat[5::53] = -float("nan")
    elif kind == "inf":
        flat[::41] = float("inf")
        flat[3::29] = -float("inf")
    elif kind == "max":
        finfo = torch.finfo(dtype)
        flat[::31] = finfo.max
        flat[7::43] = -finfo.max
        flat[2::19] = 448.0
    elif kind == "subnormal":
        x = x * (1e-39 if dtype == torch.float32 else 2.0**-20)
        x.view(-1)[::5] = 2.0**-9 * 1.5
    elif kind == "zeros":
        x[: m // 2] = 0.0
        x[:, ::3] = -0.0
    elif kind == "ties":
        grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
        grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
        mids = (grid[1:] + grid[:-1]) / 2
        x = torch.cat([mids, -mids]).repeat(m * k // (2 * mids.numel()) + 1)[: m * k]
        x = x.reshape(m, k)
        x[(torch.arange(m)[:, None] + torch.arange(k)[None, :]) % 128 == 0] = 448.0
    return x.reshape(shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# division-free power-of-two scales
# ---------------------------------------------------------------------------------------------


@triton.jit
def _pow2_kernel(amax_ptr, scale_ptr, inverse_ptr, n, eps, OVERFLOW_BITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = block_fp8.pow2_scale(tl.load(amax_ptr + offsets, mask=mask), eps, OVERFLOW_BITS)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(inverse_ptr + offsets, block_fp8.pow2_reciprocal(scale), mask=mask)


def _amax_patterns():
    """Every exponent field with the mantissas around the 1.75 boundary (0x600000) and the
    ends, random bit patterns, subnormals, zeros, infinities and NaNs."""
    exponents = torch.arange(256, dtype=torch.int64)[:, None] << 23
    mantissas = torch.tensor([0, 1, 2, 0x3FFFFF, 0x400000, 0x5FFFFF, 0x600000, 0x600001,
                              0x600002, 0x7FFFFE, 0x7FFFFF], dtype=torch.int64)[None, :]
    grid = (exponents | mantissas).reshape(-1)
    gen = torch.Generator().manual_seed(11)
    random_bits = torch.randint(0, 2**31 - 1, (20000,), generator=gen, dtype=torch.int64)
    bits = torch.cat([grid, random_bits]).to(torch.int32)
    values = bits.view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 448.0, 1.0, 1.75, 3.5,
                            1e-45, 2.0**-126, 2.0**-127, FLT_MAX, 1.3e-36])
    return torch.cat([values, special])


@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-3, 1e-40, 3e38])
@pytest.mark.parametrize("overflow", IN_DTYPES, ids=["flt_max", "bf16_max", "fp16_max"])
def test_pow2_scale_and_reciprocal_match_reference(amax_epsilon, overflow):
    amax = _amax_patterns()
    n = amax.numel()
    scale = torch.empty(n, device=DEVICE)
    inverse = torch.empty(n, device=DEVICE)
    overflow_value = float(torch.finfo(overflow).max)
    _pow2_kernel[(triton.cdiv(n, 4096),)](
        amax.to(DEVICE), scale, inverse, n, fp8_common.float32_value(amax_epsilon),
        OVERFLOW_BITS=fp8_common.float32_bits(overflow_value), BLOCK=4096)
    expected = numerics.scale_from_amax(amax, 448.0, amax_epsilon=amax_epsilon,
                                        power_2_scale=True, overflow_value=overflow_value)
    assert_bytes_equal(scale, expected, "scale")
    assert_bytes_equal(inverse, torch.reciprocal(expected), "scale_inv")


# ---------------------------------------------------------------------------------------------
# block FP8: the one kernel (block_fp8.block_tile) in each of its modes
# ---------------------------------------------------------------------------------------------

# (shape, what it exercises with a bf16 input): whole words both ways; M % 4 (transposed copy
# byte by byte); K % 4 (elements read, rowwise bytes); both odd; 3D; tiny; one word of columns
BLOCK_SHAPES = [(132, 260), (130, 132), (132, 258), (6, 9), (2, 3, 132), (4, 1), (1, 4), (4, 8)]
if CUDA:
    BLOCK_SHAPES += [(516, 1000), (1000, 516), (3, 128, 384), (1024, 2048)]
BLOCK_KINDS = ["nan", "inf", "max", "subnormal", "zeros", "ties"]
BLOCK_USAGES = [(True, True), (True, False), (False, True)]
MODES = ("HALVES", "ROW_WORDS", "COL_WORDS")


def _expected_block(x, dim, options):
    if dim == 1:
        return (*numerics.quantize_block_1d(x, **options),
                *numerics.quantize_block_1d_columnwise(x, **options))
    data, scale_inv = numerics.quantize_block_2d(x, **options)
    return (data, scale_inv, *numerics.transpose_block_2d(data, scale_inv))


def _check_block(x, dim, usage, options, what):
    """x may already be on DEVICE: a view there keeps its offset (its alignment), which a copy
    from the CPU would not."""
    quantize = block_fp8.quantize_block_1d if dim == 1 else block_fp8.quantize_block_2d
    on_device = x if x.device.type == torch.device(DEVICE).type else x.to(DEVICE)
    result = quantize(on_device, rowwise=usage[0], columnwise=usage[1], **options)
    expected = _expected_block(x.cpu(), dim, options)
    names = ("rowwise data", "rowwise scale_inv", "columnwise data", "columnwise scale_inv")
    wanted = (usage[0], usage[0], usage[1], usage[1])
    for got, ref, name, want in zip(result, expected, names, wanted, strict=True):
        if want:
            assert_bytes_equal(got, ref, f"{what} {name}", E4M3 if "data" in name else None)
            if dim == 1 and "scale" in name:  # the layout blockwise scaled_mm reads
                assert got.stride(0) == 1, f"{what} {name}: not column-major {got.stride()}"
        else:
            assert got is None, f"{what} {name} was not asked for"


def _block_input(shape, kind, dtype, seed):
    """hard_input, plus an all-zero 128x128 tile (all-zero blocks of both directions) and a row
    of the dtype's max (an overflowing row and column amax) where the shape has room."""
    x = hard_input(shape, kind, dtype, seed=seed).reshape(-1, shape[-1])
    if x.shape[0] >= 128 and x.shape[1] >= 256:
        x[:128, 128:256] = 0.0
    if kind == "random" and x.shape[0] > 3:
        x[3, :] = torch.finfo(dtype).max
    return x.reshape(shape)


@pytest.fixture
def block_modes(monkeypatch):
    """The (HALVES, ROW_WORDS, COL_WORDS) of every launch, so a test knows which modes ran."""
    seen = []
    real = block_fp8.launch

    def spy(kernel, grid, *args, **constexprs):
        seen.append(tuple(constexprs[name] for name in MODES))
        return real(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(block_fp8, "launch", spy)
    return seen


@pytest.mark.parametrize("dim", [1, 2], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_block_modes_random(block_modes, dim, dtype):
    """Every usage, power-of-two and exact scales, with and without epsilon, over shapes that
    take each mode; a bf16 input covers all of them."""
    for shape in BLOCK_SHAPES:
        x = _block_input(shape, "random", dtype, seed=sum(shape) + dim)
        for usage in BLOCK_USAGES:
            _check_block(x, dim, usage, {}, f"{dim}D {shape} {dtype} {usage}")
        _check_block(x, dim, (True, True), {"power_2_scale": False, "amax_epsilon": 1e-3},
                     f"{dim}D exact-scale eps {shape} {dtype}")
        _check_block(x, dim, (True, True), {"amax_epsilon": 2.0**-100},
                     f"{dim}D pow2 eps {shape} {dtype}")
    modes = set(block_modes)
    if dtype == torch.bfloat16:
        assert {(True, True, True), (True, True, False), (False, False, True),
                (False, False, False)} <= modes, modes
    else:
        assert all(not halves for halves, _, _ in modes)


@pytest.mark.parametrize("dim", [1, 2], ids=["1d", "2d"])
@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_block_modes_adversarial(dim, kind):
    """NaN of both signs, infinities, the dtype's max (overflowing scales), subnormal and zero
    blocks, rounding ties; power-of-two and exact scales; partial tiles in every mode."""
    shapes = [(132, 260), (130, 129)] + ([(256, 516)] if CUDA else [])
    for dtype in IN_DTYPES:
        for shape in shapes:
            x = _block_input(shape, kind, dtype, seed=shape[1])
            _check_block(x, dim, (True, True), {}, f"{dim}D {kind} {shape} {dtype}")
            _check_block(x, dim, (True, True), {"power_2_scale": False},
                         f"{dim}D exact {kind} {shape} {dtype}")


def test_block_unaligned_view(block_modes):
    """A bf16 view that is 4-byte aligned but not 8 is read element by element (same bytes)."""
    base = hard_input((12, 136), "nan", torch.bfloat16, seed=3).to(DEVICE)
    view = base.reshape(-1)[2:2 + 8 * 132].view(8, 132)
    assert view.data_ptr() % 8 != 0 and not block_fp8.reads_halves(view, 132)
    for dim in (1, 2):
        _check_block(view, dim, (True, True), {}, f"unaligned {dim}D")
    assert all(mode == (False, True, True) for mode in block_modes), block_modes


def test_block_wide_offsets(monkeypatch):
    """64-bit in-tile offsets (forced; such tensors are too large to test directly) in the
    words and the element modes."""
    monkeypatch.setattr(block_fp8, "needs_wide_offsets", lambda *args: True)
    for shape in ((132, 260), (130, 129)):
        x = hard_input(shape, "nan", torch.bfloat16)
        for dim in (1, 2):
            _check_block(x, dim, (True, True), {}, f"wide {dim}D {shape}")


@pytest.mark.parametrize("warps", [2, 8])
def test_block_warps(monkeypatch, warps):
    """Other warp counts (the kernel's layouts change with them)."""
    monkeypatch.setattr(block_fp8, "NUM_WARPS_1D", warps)
    monkeypatch.setattr(block_fp8, "NUM_WARPS_2D", warps)
    for shape in ((132, 260), (130, 129)):
        x = _block_input(shape, "nan", torch.bfloat16, seed=warps)
        for dim in (1, 2):
            _check_block(x, dim, (True, True), {}, f"w{warps} {dim}D {shape}")


# ---------------------------------------------------------------------------------------------
# MXFP8 configurations
# ---------------------------------------------------------------------------------------------

# (DIRECT_COLUMNS, BLOCK_M, BLOCK_K); BLOCK_M = 64 takes the reshaped columnwise path
CONFIGS_MX = [(True, 32, 128), (False, 32, 128), (True, 64, 64), (True, 32, 256)]
MX_SHAPES = [(32, 32), (96, 160), (64, 288), (2, 32, 96)]
if CUDA:
    MX_SHAPES += [(1024, 2080), (4, 384, 1024)]
MX_KINDS = ["nan", "inf", "max", "subnormal", "zeros", "extreme"]


def _mx_input(shape, kind, dtype, seed=0):
    if kind != "extreme":
        return hard_input(shape, kind, dtype, seed)
    x = torch.ones(shape).reshape(-1, shape[-1])
    x[:32, :32] *= 2.0**-135
    x[32:64, :32] *= 2.0**-126
    x[:32, 32:64] = torch.randn(32, 32) * 2.0**127
    x[0, 32] = FLT_MAX
    x[5, 40] = float("inf")
    x[33, 1] = float("nan")
    return x.reshape(shape).to(dtype)


def _check_mx(x, usage, elem, what):
    out = mxfp8_kernels.quantize_mxfp8(x.to(DEVICE), rowwise=usage[0], columnwise=usage[1],
                                       dtype=elem)
    ref = numerics.quantize_mxfp8(x, rowwise=usage[0], columnwise=usage[1], dtype=elem)
    assert set(out) == set(ref), what
    for name, expected in ref.items():
        fp8_dtype = elem if name.endswith("data") else None
        assert_bytes_equal(out[name], expected, f"{what} {name}", fp8_dtype)


def _set_mx(monkeypatch, config):
    for name, value in zip(("DIRECT_COLUMNS", "BLOCK_M", "BLOCK_K"), config, strict=True):
        monkeypatch.setattr(mxfp8_kernels, name, value)


@pytest.mark.parametrize("config", CONFIGS_MX, ids=str)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
def test_mxfp8_configs_random(monkeypatch, config, shape):
    _set_mx(monkeypatch, config)
    for i, dtype in enumerate(IN_DTYPES):
        x = hard_input(shape, "random", dtype, seed=sum(shape) + i)
        for elem in (E4M3, E5M2) if i == 0 else (E4M3,):
            usages = [(True, True), (True, False), (False, True)] if i == 0 else [(True, True)]
            for usage in usages:
                _check_mx(x, usage, elem, f"{config} {shape} {dtype} {elem} {usage}")


@pytest.mark.parametrize("config", CONFIGS_MX[:3], ids=str)
@pytest.mark.parametrize("kind", MX_KINDS)
def test_mxfp8_configs_adversarial(monkeypatch, config, kind):
    _set_mx(monkeypatch, config)
    for dtype in IN_DTYPES:
        x = _mx_input((64, 160), kind, dtype)
        for elem in (E4M3, E5M2):
            _check_mx(x, (True, True), elem, f"{config} {kind} {dtype} {elem}")


