"""Triton MXFP8 / NVFP4 kernels against the numerics reference, byte for byte.

The reference always runs on CPU (it is the spec); the kernels run on CUDA, or on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1, small shapes so the file stays fast). Skipped
when neither is possible. Stochastic rounding is tested statistically (NUMERICS.md §7): every
result is one of the two neighbours, the mean converges, streams are reproducible and distinct.
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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import minifloat as mf  # noqa: E402
from minifloat import numerics  # noqa: E402
from minifloat.kernels import element_cast  # noqa: E402
from minifloat.kernels import mxfp8 as mxfp8_kernels  # noqa: E402
from minifloat.kernels import nvfp4 as nvfp4_kernels  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    # the interpreter evaluates 1 / 0 (an all-zero block's element scale) through numpy
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = torch.finfo(torch.float32).max


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def random_input(shape, seed, dtype=torch.float32, spread=10):
    """Normal values with a different power-of-two magnitude per row (many block scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    rows = x.reshape(-1, shape[-1]).shape[0]
    exponents = torch.randint(-spread, spread + 1, (rows, 1), generator=gen).float()
    x = (x.reshape(rows, -1) * torch.exp2(exponents)).reshape(shape)
    return x.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8) if t.element_size() == 1 else t.cpu()


def assert_same_buffers(actual: dict, expected: dict, label: str = "") -> None:
    """Same keys, shapes and dtypes; 1-byte buffers equal byte for byte (packed E2M1 also nibble
    for nibble); fp32 amaxes equal, NaN matching NaN."""
    assert set(actual) == set(expected), label
    for name, ref in expected.items():
        out = actual[name]
        what = f"{label}{name}"
        assert out.shape == ref.shape and out.dtype == ref.dtype, what
        assert out.device.type == DEVICE.type, what
        a, b = raw(out), raw(ref)
        if a.dtype == torch.uint8:
            bad = (a != b).nonzero()
            if bad.numel():
                first = tuple(bad[0])
                raise AssertionError(
                    f"{what}: {bad.shape[0]} of {b.numel()} bytes differ, first at "
                    f"{list(first)}: {a[first].item():#04x} instead of {b[first].item():#04x}"
                )
            if name.endswith("_data") and out.dtype == torch.uint8:
                assert torch.equal(numerics.unpack_nibbles(a), numerics.unpack_nibbles(b)), what
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)


def adversarial_input(shape, kind, dtype=torch.float32):
    """A random tensor with one hard case planted; `shape` is 2D with M, K >= 32."""
    x = random_input(shape, seed=7, spread=3)
    if kind == "zeros":
        x.zero_()
    elif kind == "zero_block":
        x[0, :32] = 0.0
        x[:32, 1] = 0.0
    elif kind == "huge":
        x[1, 5] = 3.0e4
        x[9, 40] = -6.0e4
    elif kind == "flt_max":
        x[2, 3] = FLT_MAX
        x[20, 7] = -FLT_MAX
    elif kind == "inf":
        x[2, 3], x[17, 33] = float("inf"), float("-inf")
    elif kind == "nan":
        x[4, 6] = float("nan")
    elif kind == "all_nan":
        x.fill_(float("nan"))
    elif kind == "subnormal":
        x[3, :16] = torch.ldexp(torch.ones(16), torch.arange(-149, -133))
        x[5:, 1] = 2.0**-130
    elif kind == "tiny":
        x *= 1e-39  # fp32 subnormals everywhere: tiny global amax, subnormal decode scales
    elif kind == "small":
        x *= 1e-30  # S_enc overflows to FLT_MAX for NVFP4, E8M0 exponents near 0 for MXFP8
    elif kind == "fp8_ties":
        # block amax 448 (E4M3) / 57344 (E5M2) gives E8M0 scale 1: these lie halfway between
        # neighbouring E4M3 (row 0) or E5M2 (row 1) values, subnormal ones included
        x[0, :10] = torch.tensor(
            [448.0, 1.0625, 1.1875, 2.125, 2.375, 272.0, -1.0625, 0.0126953125, 0.0029296875,
             2.0**-10]
        )
        x[1, :8] = torch.tensor([57344.0, 1.125, 1.375, 2.25, 40960.0, -1.125, 2.0**-17, 0.5])
        x[2, 0], x[3, 0] = 464.0, 61440.0  # past max: saturate in their own blocks
    elif kind == "fp4_ties":
        # global amax 2688 (S_enc 1) and block amax 6 (s_b 1): elements halfway on the E2M1 grid
        x[0, 0] = 2688.0
        x[1, :16] = torch.tensor(
            [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
             -5.0, 4.5]
        )
    elif kind == "max":
        x[0, :4] = torch.tensor([448.0, -448.0, 57344.0, -57344.0])
        x[1, :4] = torch.tensor([6.0, -6.0, 6.0, -6.0])
    else:
        raise ValueError(kind)
    return x.to(dtype)


ADVERSARIAL = [
    "zeros", "zero_block", "huge", "flt_max", "inf", "nan", "all_nan", "subnormal", "tiny",
    "small", "fp8_ties", "fp4_ties", "max",
]


# --------------------------------------------------------------------------------------------
# element casts (element_cast.py) on every kind of fp32 bit pattern
# --------------------------------------------------------------------------------------------


@triton.jit
def _cast_probe_kernel(x_ptr, out_ptr, n, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
                       MAX_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    mantissa, exponent = element_cast.split_magnitude(element_cast.magnitude_bits(x))
    code = element_cast.round_to_code(mantissa, exponent, MANT, MIN_EXP, MAX_CODE)
    code = code | (element_cast.sign_bit(x) << SIGN_SHIFT)
    tl.store(out_ptr + offsets, code, mask=mask)


@triton.jit
def _helpers_probe_kernel(x_ptr, bf16_ptr, e8m0_ptr, code_ptr, decoded_ptr, n,
                          RECIPROCAL_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(bf16_ptr + offsets, element_cast.round_to_bf16(x), mask=mask)
    amax = element_cast.magnitude_bits(x).to(tl.float32, bitcast=True)
    tl.store(e8m0_ptr + offsets, element_cast.e8m0_exponent(amax, RECIPROCAL_BITS), mask=mask)
    codes = tl.load(code_ptr + offsets, mask=mask, other=0)
    tl.store(decoded_ptr + offsets, element_cast.e4m3_code_to_float(codes), mask=mask)


def _bit_patterns(n=1 << 14, seed=0):
    """Random fp32 bit patterns over every exponent (no NaN), plus edge values."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    bits = torch.where(torch.rand(n, generator=gen) < 0.5, bits, -bits).to(torch.int32)
    values = bits.view(torch.float32)
    values = torch.where(values.isnan(), torch.zeros_like(values), values)
    # dense coverage of the formats' ranges, including ties and exact grid points
    fine = torch.ldexp(torch.arange(0, 4096).float() / 64, torch.full((4096,), -10))
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), FLT_MAX, -FLT_MAX, 448.0,
                          464.0, 480.0, 57344.0, 61440.0, 6.0, 7.0, 5.0, 2.0**-149, 2.0**-126])
    return torch.cat((values, fine, fine * 64, -fine * 4096, edges))


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2", "E2M1"])
def test_round_to_code_matches_reference_casts(fmt):
    x = _bit_patterns()
    if fmt == "E2M1":
        expected = numerics.encode_e2m1(numerics.round_to_format(x, numerics.E2M1))
        constants, sign_shift = element_cast.E2M1_CONSTANTS, 3
    else:
        dtype = E4M3 if fmt == "E4M3" else E5M2
        expected = numerics.cast_to_fp8(x, dtype).view(torch.uint8)
        constants = element_cast.E4M3_CONSTANTS if fmt == "E4M3" else element_cast.E5M2_CONSTANTS
        sign_shift = 7
    xd = x.to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.int32, device=DEVICE)
    block = 1024
    _cast_probe_kernel[(triton.cdiv(x.numel(), block),)](
        xd, out, x.numel(), *constants, sign_shift, block
    )
    got = out.cpu().to(torch.uint8)
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{fmt}: {x[bad[:5]].tolist()} -> {got[bad[:5]].tolist()} " \
                             f"instead of {expected[bad[:5]].tolist()}"


def test_bf16_e8m0_and_e4m3_decode_helpers():
    x = _bit_patterns(n=1 << 12, seed=1)
    x = torch.cat((x, torch.tensor([float("nan"), 2.0**-127, 2.0**-135, 448.0 * 2.0**127])))
    n = x.numel()
    codes = torch.arange(n, dtype=torch.int32) % 128
    bf16 = torch.empty(n, device=DEVICE)
    e8m0 = torch.empty(n, dtype=torch.int32, device=DEVICE)
    decoded = torch.empty(n, device=DEVICE)
    block = 1024
    _helpers_probe_kernel[(triton.cdiv(n, block),)](
        x.to(DEVICE), bf16, e8m0, codes.to(DEVICE), decoded, n,
        mxfp8_kernels._reciprocal_bits(448.0), block,
    )
    torch.testing.assert_close(bf16.cpu(), x.to(torch.bfloat16).float(), rtol=0, atol=0,
                               equal_nan=True)
    expected_e8m0 = numerics.e8m0_exponent(x.abs()).to(torch.int32)
    assert torch.equal(e8m0.cpu(), expected_e8m0)
    expected_decoded = codes.to(torch.uint8).view(E4M3).float()
    torch.testing.assert_close(decoded.cpu(), expected_decoded, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------

MXFP8_SHAPES = [(32, 32), (64, 128), (96, 160), (2, 16, 64), (3, 32, 96)]
if DEVICE.type == "cuda":
    MXFP8_SHAPES += [(1024, 2048), (4, 384, 1024)]


def _mxfp8_both(x, dtype, rowwise=True, columnwise=True):
    out = mxfp8_kernels.quantize_mxfp8(
        x.to(DEVICE), rowwise=rowwise, columnwise=columnwise, dtype=dtype
    )
    ref = numerics.quantize_mxfp8(x, rowwise=rowwise, columnwise=columnwise, dtype=dtype)
    return out, ref


@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", MXFP8_SHAPES, ids=str)
def test_mxfp8_random_inputs(shape, in_dtype, elem):
    x = random_input(shape, seed=sum(shape), dtype=in_dtype)
    out, ref = _mxfp8_both(x, elem)
    assert_same_buffers(out, ref, f"{shape}/{in_dtype}/{elem}.")


@pytest.mark.parametrize("usage", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
def test_mxfp8_single_direction(usage):
    x = random_input((64, 96), seed=3)
    out, ref = _mxfp8_both(x, E4M3, *usage)
    assert_same_buffers(out, ref)


@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_mxfp8_adversarial(kind, elem):
    for in_dtype in INPUT_DTYPES:
        x = adversarial_input((64, 96), kind, in_dtype)
        out, ref = _mxfp8_both(x, elem)
        assert_same_buffers(out, ref, f"{kind}/{in_dtype}.")


def test_mxfp8_extreme_block_exponents():
    """Blocks at the ends of the E8M0 range: exponent 0 (subnormal amax * R), the largest finite
    amax, and an infinite one (254: the element scale 2^-127 is an fp32 subnormal)."""
    x = torch.ones(64, 64)
    x[0:32, 0:32] *= 2.0**-135
    x[32:64, 0:32] *= 2.0**-126
    x[0:32, 32:64] = torch.randn(32, 32) * 2.0**127
    x[0, 32] = FLT_MAX
    x[32:64, 32:64] = torch.randn(32, 32) * 2.0**100
    x[40, 40] = float("inf")
    for elem in (E4M3, E5M2):
        out, ref = _mxfp8_both(x, elem)
        assert_same_buffers(out, ref)
        assert {0, 254} <= set(ref["rowwise_scale"].unique().tolist())


def test_mxfp8_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp8_kernels.quantize_mxfp8(torch.zeros(32, 48, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        mxfp8_kernels.quantize_mxfp8(torch.zeros(64, 32, device=DEVICE).t())


# MXFP8 v3: the words kernel (bf16 inputs: int64 words in, int32 code words out)


def _words_input(shape, seed):
    """bf16 with every special a block can hold: NaN of either sign, infinities, FLT_MAX-range
    blocks (E8M0 254 next to an infinity), subnormal-range blocks (E8M0 0 and 1), ties."""
    x = random_input(shape, seed=seed, spread=20)
    m, k = x.shape
    x[0, 3] = float("nan")
    x[5, 40 % k] = float("inf")
    x[6, 7] = -float("inf")
    x[10, :16] = torch.ldexp(torch.ones(16), torch.arange(-140, -124))
    x[11, :8] = torch.tensor([448.0, 1.0625, 1.1875, -2.375, 272.0, 2.0**-10, 57344.0, 1.375])
    if m >= 64:
        x[32:64, :32] = torch.randn(32, 32) * 2.0**-135
        x[33, 1] = -float("nan")
        x[40, 0] = FLT_MAX
        x[48, 33 % k] = -FLT_MAX
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("words_k", [128, 64, 256])
@pytest.mark.parametrize("shape", [(32, 32), (64, 160), (64, 288)], ids=str)
def test_mxfp8_words_kernel_products(monkeypatch, shape, words_k):
    """Every tile width, masked and unmasked K, each usage and element format, through the CUDA
    algorithm (fp32 products with exact power-of-two factors, the subnormal 2^-127 included;
    NaN blocks overwritten per word; halfwise maxima): under the interpreter EMULATE_PRODUCTS
    runs it with the integer cast standing in for cvt.rn.satfinite. (The interpreter's own
    integer path of the words kernel serves every bf16 case of the tests above.)"""
    monkeypatch.setattr(mxfp8_kernels, "WORDS_BLOCK_K", words_k)
    monkeypatch.setattr(mxfp8_kernels, "EMULATE_PRODUCTS", True)
    x = _words_input(shape, seed=sum(shape) + words_k)
    assert mxfp8_kernels._takes_words(x.to(DEVICE))
    for elem, usage in [(E4M3, (True, True)), (E4M3, (True, False)), (E4M3, (False, True)),
                        (E5M2, (True, True))]:
        out, ref = _mxfp8_both(x, elem, *usage)
        assert_same_buffers(out, ref, f"{shape}/{words_k}/{elem}/{usage}.")


def test_mxfp8_words_fallbacks(monkeypatch):
    """The words kernel takes bf16 at 8-byte aligned addresses only; other inputs (and WORDS
    off) take the element kernel, with the same bytes."""
    base = _words_input((64, 160 + 2), seed=5).to(DEVICE)
    shifted = base.flatten()[2:2 + 64 * 160].view(64, 160)  # 4-byte aligned, not 8
    aligned = shifted.clone()
    assert not mxfp8_kernels._takes_words(shifted)
    assert mxfp8_kernels._takes_words(aligned)
    assert not mxfp8_kernels._takes_words(aligned.float())
    out, ref = _mxfp8_both(shifted.cpu(), E4M3)
    assert_same_buffers(out, ref, "shifted.")
    words = mxfp8_kernels.quantize_mxfp8(aligned, rowwise=True, columnwise=True)
    monkeypatch.setattr(mxfp8_kernels, "WORDS", False)
    assert not mxfp8_kernels._takes_words(aligned)
    elements = mxfp8_kernels.quantize_mxfp8(aligned, rowwise=True, columnwise=True)
    for name in words:
        assert torch.equal(raw(words[name]), raw(elements[name])), name


@triton.jit
def _e8m0_probe_kernel(amax_ptr, fast_ptr, reference_ptr, n, RECIPROCAL_BITS: tl.constexpr,
                       BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    amax = tl.load(amax_ptr + offsets, mask=mask, other=0.0)
    tl.store(fast_ptr + offsets, mxfp8_kernels._e8m0(amax, RECIPROCAL_BITS), mask=mask)
    tl.store(reference_ptr + offsets, element_cast.e8m0_exponent(amax, RECIPROCAL_BITS),
             mask=mask)


@pytest.mark.parametrize("element_max", [448.0, 57344.0], ids=["e4m3", "e5m2"])
def test_mxfp8_fast_e8m0_on_every_bf16_magnitude(element_max):
    """_e8m0 (the words kernel's scale rule) equals element_cast.e8m0_exponent and the
    reference for every non-negative bf16 pattern (the words kernel's amaxes are bf16), NaNs,
    infinity, zero and subnormals included; plus random fp32 amaxes."""
    bf16_bits = torch.arange(0, 0x8000, dtype=torch.int32) << 16
    gen = torch.Generator().manual_seed(11)
    fp32_bits = torch.randint(0, 0x7F800001, (1 << 14,), generator=gen, dtype=torch.int32)
    amax = torch.cat((bf16_bits, fp32_bits)).view(torch.float32)
    n = amax.numel()
    fast = torch.empty(n, dtype=torch.int32, device=DEVICE)
    reference = torch.empty(n, dtype=torch.int32, device=DEVICE)
    block = 1024
    _e8m0_probe_kernel[(triton.cdiv(n, block),)](
        amax.to(DEVICE), fast, reference, n, mxfp8_kernels._reciprocal_bits(element_max), block
    )
    assert torch.equal(fast.cpu(), reference.cpu())
    finite = ~amax.isnan()
    expected = numerics.e8m0_exponent(amax[finite], element_max).to(torch.int32)
    assert torch.equal(fast.cpu()[finite], expected)


# --------------------------------------------------------------------------------------------
# NVFP4 (round to nearest): bytes
# --------------------------------------------------------------------------------------------

NVFP4_SHAPES = [(16, 16), (48, 80), (64, 128), (2, 8, 32), (3, 16, 48)]
if DEVICE.type == "cuda":
    NVFP4_SHAPES += [(1024, 2048), (4, 272, 1040)]
NVFP4_MODES = {
    "1d": {},
    "rht": {"with_rht": True},
    "2d": {"two_dimensional": True},
}


def _nvfp4_both(x, rowwise=True, columnwise=True, reduce_amax=None, **options):
    kwargs = dict(rowwise=rowwise, columnwise=columnwise, **options)
    out = nvfp4_kernels.quantize_nvfp4(x.to(DEVICE), reduce_amax=reduce_amax, **kwargs)
    ref = numerics.quantize_nvfp4(x, reduce_amax=reduce_amax, **kwargs)
    return out, ref


@pytest.mark.parametrize("mode", NVFP4_MODES)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
def test_nvfp4_random_inputs(shape, in_dtype, mode):
    x = random_input(shape, seed=sum(shape), dtype=in_dtype)
    out, ref = _nvfp4_both(x, **NVFP4_MODES[mode])
    assert_same_buffers(out, ref, f"{shape}/{in_dtype}/{mode}.")


@pytest.mark.parametrize("usage", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("mode", NVFP4_MODES)
def test_nvfp4_single_direction(mode, usage):
    x = random_input((48, 64), seed=5, dtype=torch.bfloat16)
    out, ref = _nvfp4_both(x, *usage, **NVFP4_MODES[mode])
    assert_same_buffers(out, ref)


@pytest.mark.parametrize("mode", NVFP4_MODES)
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_nvfp4_adversarial(kind, mode):
    for in_dtype in INPUT_DTYPES:
        x = adversarial_input((64, 96), kind, in_dtype)
        out, ref = _nvfp4_both(x, **NVFP4_MODES[mode])
        assert_same_buffers(out, ref, f"{kind}/{in_dtype}.")


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_nvfp4_2d_words_kernel_adversarial(monkeypatch, kind):
    """The 16x16 words kernel (nvfp4.WORDS_2D, bf16 only) on every planted hard case, with a
    reduced amax between the kernels as the quantizer may apply."""
    monkeypatch.setattr(nvfp4_kernels, "WORDS_2D", True)
    monkeypatch.setattr(nvfp4_kernels, "WORDS_BLOCK_M_2D", 32)
    monkeypatch.setattr(nvfp4_kernels, "WORDS_BLOCK_K_2D", 64)
    monkeypatch.setattr(nvfp4_kernels, "WORDS_NUM_WARPS_2D", 1)
    x = adversarial_input((64, 96), kind, torch.bfloat16)
    out, ref = _nvfp4_both(x, two_dimensional=True)
    assert_same_buffers(out, ref, f"{kind}.")
    out, ref = _nvfp4_both(x, two_dimensional=True, reduce_amax=lambda amax: amax * 4.0)
    assert_same_buffers(out, ref, f"{kind}/reduced.")


def test_nvfp4_fp4_ties_round_to_even():
    x = adversarial_input((32, 32), "fp4_ties")
    out, _ = _nvfp4_both(x)
    assert out["rowwise_scale"].view(torch.uint8)[1, 0].item() == 0x38  # s_b = 1.0
    values = numerics.e2m1_to_float(out["rowwise_data"].cpu())[1, :16]
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0,
                4.0]
    assert values.tolist() == expected


@pytest.mark.parametrize("mode", NVFP4_MODES)
def test_nvfp4_reduce_amax_between_kernels(mode):
    """The quantizer's reduction runs on the device amaxes, in the reference's order."""
    calls = []

    def reduce_amax(amax):
        calls.append(amax.device.type)
        return amax * 4.0  # as if another rank held a larger amax

    x = random_input((32, 48), seed=9)
    out, ref = _nvfp4_both(x, reduce_amax=reduce_amax, **NVFP4_MODES[mode])
    assert_same_buffers(out, ref)
    assert calls == [DEVICE.type] * (len(calls) // 2) + ["cpu"] * (len(calls) // 2)
    assert len(calls) == (4 if mode == "rht" else 2)


def test_nvfp4_rejects_bad_options():
    with pytest.raises(ValueError, match="no RHT"):
        nvfp4_kernels.quantize_nvfp4(
            torch.zeros(16, 16, device=DEVICE), two_dimensional=True, with_rht=True
        )
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_kernels.quantize_nvfp4(torch.zeros(16, 24, device=DEVICE))


# --------------------------------------------------------------------------------------------
# NVFP4 stochastic rounding: statistics
# --------------------------------------------------------------------------------------------

E2M1_GRID = torch.tensor(numerics.formats.E2M1_VALUES)


def _scaled_targets(x_t: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, amax):
    """The exact fp32 values the E2M1 rounding saw (x * element scale, as the reference forms
    them) and the kernel's decoded E2M1 values, for one direction's [R, C] layout."""
    s_dec = numerics.global_decode_scale(amax.cpu().reshape(()))
    element_scale = torch.clamp(torch.reciprocal(scale.cpu().float() * s_dec), max=FLT_MAX)
    scaled = x_t.float() * element_scale.repeat_interleave(16, dim=1)
    return scaled, numerics.e2m1_to_float(data.cpu())


def _assert_neighbours(scaled: torch.Tensor, values: torch.Tensor) -> None:
    clamped = scaled.clamp(-6.0, 6.0)
    magnitude = clamped.abs().reshape(-1, 1)
    lower = E2M1_GRID[(E2M1_GRID[None, :] <= magnitude).sum(1) - 1].reshape(scaled.shape)
    upper = E2M1_GRID[torch.clamp(8 - (E2M1_GRID[None, :] >= magnitude).sum(1), max=7)]
    upper = upper.reshape(scaled.shape)
    sign = torch.where(clamped < 0, -1.0, 1.0)
    ok = (values == sign * lower) | (values == sign * upper)
    assert ok.all(), f"{(~ok).sum().item()} results are not a neighbour of their input"


@pytest.mark.parametrize("mode", NVFP4_MODES)
def test_nvfp4_sr_results_are_neighbours_with_exact_scales(mode):
    options = NVFP4_MODES[mode]
    x = random_input((64, 96), seed=21, dtype=torch.bfloat16)
    torch.manual_seed(0)
    out = nvfp4_kernels.quantize_nvfp4(
        x.to(DEVICE), rowwise=True, columnwise=True, stochastic_rounding=True, **options
    )
    ref = numerics.quantize_nvfp4(x, rowwise=True, columnwise=True, **options)
    for name in ("rowwise_scale", "columnwise_scale", "amax_rowwise", "amax_columnwise"):
        assert_same_buffers({name: out[name]}, {name: ref[name]})
    x_t = x.t()
    if options.get("with_rht"):
        x_t = numerics.random_hadamard_transform(x_t)
    for direction, source in (("rowwise", x), ("columnwise", x_t)):
        scaled, values = _scaled_targets(
            source, out[f"{direction}_data"], out[f"{direction}_scale"], out[f"amax_{direction}"]
        )
        _assert_neighbours(scaled, values)
        rne = numerics.e2m1_to_float(ref[f"{direction}_data"])
        assert not torch.equal(values, rne), "stochastic rounding left every value at RNE"


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_nvfp4_sr_mean_converges_without_bias(direction):
    """Identical values repeated across the other dim: their dequantized mean converges to the
    exact scaled value (standard error bound), and the average error is ~0."""
    run = torch.linspace(-5.9, 5.9, 32)  # scaled to about [-6, 6]: every E2M1 step is used
    repeats = 512 if DEVICE.type == "cuda" else 128
    x = run[None, :].repeat(repeats, 1) if direction == "rowwise" else run[:, None].repeat(
        1, repeats)
    torch.manual_seed(1)
    out = nvfp4_kernels.quantize_nvfp4(
        x.to(DEVICE), rowwise=direction == "rowwise", columnwise=direction == "columnwise",
        stochastic_rounding=True,
    )
    source = x if direction == "rowwise" else x.t()
    scaled, values = _scaled_targets(
        source, out[f"{direction}_data"], out[f"{direction}_scale"], out[f"amax_{direction}"]
    )
    assert torch.equal(scaled, scaled[:1].expand_as(scaled))
    target = scaled[0].clamp(-6, 6)
    mean = values.mean(dim=0)
    # the E2M1 step is at most 2, so a draw's standard deviation is at most 1
    assert (mean - target).abs().max() < 5.0 / repeats**0.5
    assert abs((values - scaled.clamp(-6, 6)).mean().item()) < 3.0 / values.numel() ** 0.5


@pytest.mark.parametrize("mode", NVFP4_MODES)
def test_nvfp4_sr_reproducible_under_manual_seed(mode):
    x = random_input((32, 64), seed=22)
    results = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        results.append(nvfp4_kernels.quantize_nvfp4(
            x.to(DEVICE), rowwise=True, columnwise=True, stochastic_rounding=True,
            **NVFP4_MODES[mode],
        ))
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(raw(results[0][name]), raw(results[1][name])), name
        assert not torch.equal(raw(results[0][name]), raw(results[2][name])), name


def test_nvfp4_sr_directions_use_separate_streams():
    """A symmetric input has equal rowwise and columnwise targets; shared draws would make the
    two copies identical."""
    a = random_input((64, 64), seed=23)
    x = (a + a.t()) / 2
    torch.manual_seed(2)
    out = nvfp4_kernels.quantize_nvfp4(
        x.to(DEVICE), rowwise=True, columnwise=True, stochastic_rounding=True
    )
    assert torch.equal(raw(out["rowwise_scale"]), raw(out["columnwise_scale"]))
    assert not torch.equal(raw(out["rowwise_data"]), raw(out["columnwise_data"]))


# --------------------------------------------------------------------------------------------
# dispatch from the quantizers
# --------------------------------------------------------------------------------------------


def _forbid_reference(monkeypatch, name):
    def fail(*args, **kwargs):
        raise AssertionError(f"numerics.{name} ran although the kernel applies")

    monkeypatch.setattr(numerics, name, fail)


@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
def test_mxfp8_quantizer_uses_kernel(monkeypatch, in_dtype):
    x = random_input((2, 32, 64), seed=30, dtype=in_dtype)
    expected = mf.MXFP8Quantizer(internal=True)(x)  # CPU tensor here unless interpreting
    monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", "1")
    reference = mf.MXFP8Quantizer(internal=True)(x.to(DEVICE))
    monkeypatch.delenv("MINIFLOAT_DISABLE_KERNELS")
    _forbid_reference(monkeypatch, "quantize_mxfp8")
    got = mf.MXFP8Quantizer(internal=True)(x.to(DEVICE))
    for name in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
        assert torch.equal(raw(getattr(got, name)), raw(getattr(reference, name))), name
        if DEVICE.type == "cuda":
            assert torch.equal(raw(getattr(got, name)), raw(getattr(expected, name))), name


@pytest.mark.parametrize(
    "options",
    [{}, {"with_rht": True}, {"with_2d_quantization": True}],
    ids=["1d", "rht", "2d"],
)
def test_nvfp4_quantizer_uses_kernel(monkeypatch, options):
    x = random_input((3, 16, 48), seed=31, dtype=torch.bfloat16)
    monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", "1")
    reference = mf.NVFP4Quantizer(internal=True, **options)(x.to(DEVICE))
    monkeypatch.delenv("MINIFLOAT_DISABLE_KERNELS")
    _forbid_reference(monkeypatch, "quantize_nvfp4")
    got = mf.NVFP4Quantizer(internal=True, **options)(x.to(DEVICE))
    for name in reference.tensor_fields():
        a, b = getattr(got, name), getattr(reference, name)
        assert torch.equal(raw(a), raw(b)), name
    torch.testing.assert_close(got.dequantize(), reference.dequantize(), rtol=0, atol=0)


def test_quantizers_fall_back_for_non_contiguous_inputs(monkeypatch):
    x = random_input((64, 32), seed=32).to(DEVICE).t()
    called = []
    original = numerics.quantize_mxfp8

    def spy(*args, **kwargs):
        called.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(numerics, "quantize_mxfp8", spy)
    mf.MXFP8Quantizer(internal=True)(x)
    assert called
