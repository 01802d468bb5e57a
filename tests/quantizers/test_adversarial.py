"""Adversarial inputs: zeros, one huge value, inf, NaN, rounding ties, tiny values, shapes the
formats cannot hold, 0-dim tensors and wrong dtypes."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

from .cases import (
    ALL,
    E4M3,
    E5M2,
    FAMILIES,
    USAGE_IDS,
    USAGES,
    _spread,
    _tile_absmax,
    as_bytes,
    check_buffers,
    family_input,
    plain_block_fp8,
    torch_fp8,
)
from .test_storage import elementwise_bound

DIRECTIONS = [(True, False), (False, True)]
DIRECTION_IDS = ["rowwise", "columnwise"]
QUANTIZED = [n for n in ALL if n != "identity"]


def _deq(name, x, usage, seed=1234):
    return FAMILIES[name].quantize(x, *usage, internal=True, seed=seed)


# --------------------------------------------------------------------------------------------
# zeros
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_all_zeros(name, usage):
    family = FAMILIES[name]
    x = torch.zeros(family.shape)
    storage = _deq(name, x, usage)
    check_buffers(storage, family, x, *usage, family.expected(x, *usage))
    values = storage.dequantize()
    assert torch.equal(values, x)
    for n in storage.tensor_fields():
        buffer = getattr(storage, n)
        if buffer is not None:
            assert not torch.isnan(buffer.float()).any(), n
    if isinstance(storage, mf.Float8Storage) and name != "delayed_e4m3":
        assert storage.scale_inv.item() == 1.0  # amax 0 -> scale 1 (NUMERICS.md §2.3)
    if isinstance(storage, mf.Float8BlockStorage):
        for n in ("rowwise_scale_inv", "columnwise_scale_inv"):
            if getattr(storage, n) is not None:
                assert (getattr(storage, n) == 1.0).all()
    if isinstance(storage, mf.MXFP8Storage):
        for n in ("rowwise_scale", "columnwise_scale"):
            if getattr(storage, n) is not None:
                assert (getattr(storage, n) == 0).all()  # v = 0 -> 0 (NUMERICS.md §5)


@pytest.mark.parametrize("name", QUANTIZED)
def test_zero_blocks_inside_a_tensor(name):
    family = FAMILIES[name]
    x = family_input(family, seed=2)
    x[:32] = 0.0  # whole row blocks (and some column blocks) of zeros
    x[:, :32] = 0.0
    for usage in DIRECTIONS:
        values = _deq(name, x, usage).dequantize()
        assert not torch.isnan(values).any()
        assert (values[:32] == 0).all() and (values[:, :32] == 0).all()
        bound = elementwise_bound(name, x, "rowwise" if usage[0] else "columnwise")
        if bound is not None:
            assert ((values - x).abs() <= bound).all()


# --------------------------------------------------------------------------------------------
# one huge value among small ones
# --------------------------------------------------------------------------------------------


def test_per_tensor_e4m3_huge_value_flushes_the_small_ones():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 1e-3
    x[5, 9] = 1e4
    for q in (mf.Float8CurrentScalingQuantizer(E4M3),):
        values = q(x).dequantize()
        assert not torch.isnan(values).any()
        assert abs(values[5, 9].item() - 1e4) <= 1e4 * 2**-4
        # decode scale 1e4/448: anything below half the smallest subnormal (2^-10 * 1e4/448 =
        # 0.0218) rounds to zero; these are all < 0.006
        small = torch.ones_like(x, dtype=torch.bool)
        small[5, 9] = False
        assert (values[small] == 0).all()


def test_per_tensor_e5m2_huge_value_keeps_the_small_ones():
    """E5M2's range: 1e-3 * 57344/1e4 = 5.7e-3 is above its smallest normal (2^-14)."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 1e-3
    x[5, 9] = 1e4
    values = mf.Float8CurrentScalingQuantizer(E5M2)(x).dequantize()
    bound = elementwise_bound("current_e5m2", x, "rowwise")
    assert ((values - x).abs() <= bound).all()
    assert (values != 0).float().mean() > 0.99


def _outside_block(name, shape, i, j, rowwise):
    """Mask of the elements that share no block (in the copy read) with element (i, j)."""
    family = FAMILIES[name]
    outside = torch.ones(shape, dtype=torch.bool)
    if name == "block_2d":
        tile = 128
    elif name == "nvfp4_2d":
        tile = 16
    else:
        tile = None
    if tile:
        rows = slice(i // tile * tile, (i // tile + 1) * tile)
        outside[rows, j // tile * tile:(j // tile + 1) * tile] = False
        return outside
    b = 128 if "block" in family.tags else family.block
    if rowwise:
        outside[i, j // b * b:(j // b + 1) * b] = False
    else:
        outside[i // b * b:(i // b + 1) * b, j] = False
    return outside


@pytest.mark.parametrize("name", [n for n in QUANTIZED if "per_tensor" not in FAMILIES[n].tags])
def test_block_formats_confine_a_huge_value_to_its_block(name):
    """Elements outside the huge value's block keep their usual error bound. NVFP4's global
    scale is shared, so its other blocks may lose precision (UE4M3 block scales go subnormal or
    flush to zero) but never grow beyond their own magnitude, nor become NaN/inf."""
    family = FAMILIES[name]
    x = family_input(family, seed=4)
    x[5, 9] = 1e4
    for usage in DIRECTIONS:
        values = _deq(name, x, usage).dequantize()
        assert torch.isfinite(values).all()
        assert abs(values[5, 9].item() - 1e4) <= 1e4 * 0.25 or (
            name == "nvfp4_rht" and usage[1]
        )
        outside = _outside_block(name, x.shape, 5, 9, usage[0])
        err = (values - x).abs()
        if "nvfp4" in family.tags:
            # S_enc = 2688 / 1e4 puts the other blocks' UE4M3 scales in the subnormal range
            # (quantum 2^-9 of ~0.05..0.2): coarse, so no 25% bound, but an element never moves
            # by more than half its block's amax (a full one with SR), and is never NaN/inf
            if name == "nvfp4_rht" and usage[1]:
                continue
            tile = (16, 16) if name == "nvfp4_2d" else (1, 16) if usage[0] else (16, 1)
            bamax = _spread(_tile_absmax(x, *tile), *tile, x.shape)
            limit = bamax * (1.0 if family.stochastic else 0.5)
            assert (err <= limit)[outside].all()
        else:
            bound = elementwise_bound(name, x, "rowwise" if usage[0] else "columnwise")
            assert (err <= bound)[outside].all()
        if name == "nvfp4_rht" and usage[1]:
            continue  # its huge run's error spreads through the inverse transform
        assert (err <= 0.25 * 1e4)[~outside].all()


# --------------------------------------------------------------------------------------------
# inf saturates (NUMERICS.md §1)
# --------------------------------------------------------------------------------------------


def _with_infs(family):
    x = family_input(family, seed=5)
    x[3, 5] = float("inf")
    x[10, 7] = float("-inf")
    return x


@pytest.mark.parametrize("usage", DIRECTIONS, ids=DIRECTION_IDS)
@pytest.mark.parametrize("name", QUANTIZED)
def test_inf_saturates(name, usage):
    family = FAMILIES[name]
    x = _with_infs(family)
    storage = _deq(name, x, usage)
    check_buffers(storage, family, x, *usage, family.expected(x, *usage))
    values = storage.dequantize()
    assert not torch.isnan(values).any()
    pos, neg = values[3, 5].item(), values[10, 7].item()
    assert pos > 0 and neg < 0
    fp8 = getattr(storage, "fp8_dtype", E4M3)
    fmax = torch.finfo(fp8).max
    if isinstance(storage, (mf.Float8Storage, mf.Float8BlockStorage)):
        # the element saturates to +-max (bytes 0x7E / 0x7B); an infinite amax gives scale 1
        # (§2.3), delayed scaling keeps its state scale
        decode = 1 / 32 if name == "delayed_e4m3" else 1.0
        assert (pos, neg) == (fmax * decode, -fmax * decode)
        if isinstance(storage, mf.Float8Storage):
            data = storage.data if usage[0] else storage.data_transpose.t()
        else:
            data = storage.rowwise_data if usage[0] else storage.columnwise_data.t()
        code = 0x7E if fp8 == E4M3 else 0x7B
        assert as_bytes(data[3:4, 5:6]).item() == code
        assert as_bytes(data[10:11, 7:8]).item() == code | 0x80
        assert torch.isfinite(values).all()
    elif isinstance(storage, mf.MXFP8Storage):
        # v = inf -> E8M0 0xFE; element sat(inf * 2^-127) = max; decoding max * 2^127
        # overflows fp32, so the dequantized value is +-inf (the spec's own arithmetic)
        data, scale = (
            (storage.rowwise_data, storage.rowwise_scale)
            if usage[0]
            else (storage.columnwise_data, storage.columnwise_scale)
        )
        assert data[3, 5].float().item() == fmax and data[10, 7].float().item() == -fmax
        if usage[0]:
            assert scale[3, 0].item() == 0xFE and scale[10, 0].item() == 0xFE
        else:
            assert scale[0, 5].item() == 0xFE and scale[0, 7].item() == 0xFE
        assert pos == float("inf") or pos > 1e38
        assert neg == float("-inf") or neg < -1e38
        finite_blocks = torch.ones_like(x, dtype=torch.bool)
        if usage[0]:
            finite_blocks[3, :32] = finite_blocks[10, :32] = False
        else:
            finite_blocks[:32, 5] = finite_blocks[:32, 7] = False
        assert torch.isfinite(values[finite_blocks]).all()
    else:  # NVFP4: A = inf gives S_enc = 1; the block scale saturates to 448, the element to 6
        assert torch.isfinite(values).all()
        if not (family.tags & {"rht"} and usage[1]):
            assert (pos, neg) == (6 * 448.0, -6 * 448.0)


def test_identity_passes_inf_through():
    x = _with_infs(FAMILIES["identity"])
    values = mf.IdentityQuantizer()(x).dequantize()
    assert values[3, 5].item() == float("inf") and values[10, 7].item() == float("-inf")


# --------------------------------------------------------------------------------------------
# NaN stays NaN (never a finite number)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_nan_dequantizes_to_nan(name, usage):
    family = FAMILIES[name]
    x = family_input(family, seed=6)
    spots = [(3, 5), (40, 100 % x.shape[1]), (17, 33)]
    x[3, 5] = float("nan")
    x[40, 100 % x.shape[1]] = -float("nan")
    x[17, 33] = float("nan")
    storage = _deq(name, x, usage)
    values = storage.dequantize()
    for i, j in spots:
        assert torch.isnan(values[i, j]), (i, j)
    if usage != (True, True):
        # the copy actually read is the requested one; check the other direction too
        return
    for single in DIRECTIONS:
        values = _deq(name, x, single).dequantize()
        assert all(torch.isnan(values[i, j]) for i, j in spots)


@pytest.mark.parametrize("usage", DIRECTIONS, ids=DIRECTION_IDS)
@pytest.mark.parametrize("name", [n for n in QUANTIZED if FAMILIES[n].block])
def test_nan_poisons_its_whole_block(name, usage):
    """MXFP8: the block's E8M0 scale is 0xFF (NaN), so all 32 elements decode to NaN.
    NVFP4: a NaN makes the block scale NaN (§1), so the whole 16-block (16x16 tile in 2D) is
    NaN; the global amax is NaN as well, so NaN may spread further, never to a finite number."""
    family = FAMILIES[name]
    x = family_input(family, seed=7)
    i, j = 21, 37
    x[i, j] = float("nan")
    values = _deq(name, x, usage).dequantize()
    b = family.block
    if name == "nvfp4_2d":
        block = values[i // 16 * 16:(i // 16 + 1) * 16, j // 16 * 16:(j // 16 + 1) * 16]
    elif usage[0]:
        block = values[i, j // b * b:(j // b + 1) * b]
    else:
        block = values[i // b * b:(i // b + 1) * b, j]
    if name == "nvfp4_rht" and usage[1]:
        assert torch.isnan(values[:, j]).all() or torch.isnan(values).all()
    else:
        assert torch.isnan(block).all(), f"{int((~torch.isnan(block)).sum())} finite in block"
    if family.block == 32:
        scale = _deq(name, x, usage)
        grid = scale.rowwise_scale if usage[0] else scale.columnwise_scale
        assert (grid == 0xFF).sum().item() == 1
        outside = torch.ones_like(x, dtype=torch.bool)
        if usage[0]:
            outside[i, j // b * b:(j // b + 1) * b] = False
        else:
            outside[i // b * b:(i // b + 1) * b, j] = False
        assert torch.isfinite(values[outside]).all()


def test_nan_in_per_tensor_formats_stays_where_it_was():
    """amax NaN -> scale 1 (§2.3): the NaN stays NaN, the other elements stay finite."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(8))
    x[4, 4] = float("nan")
    for q in (mf.Float8CurrentScalingQuantizer(E4M3), mf.Float8CurrentScalingQuantizer(E5M2),
              mf.Float8BlockQuantizer(1), mf.Float8BlockQuantizer(2),
              mf.Float8Quantizer(torch.tensor([8.0]), torch.zeros(1))):
        values = q(x).dequantize()
        assert torch.isnan(values[4, 4])
        assert torch.isnan(values).sum().item() == 1, type(q).__name__


# --------------------------------------------------------------------------------------------
# rounding ties, subnormals, +-max, tiny amax
# --------------------------------------------------------------------------------------------


def test_per_tensor_e4m3_ties_subnormals_and_max():
    """amax = 448 makes the scale exactly 1, so the elements are rounded as they are."""
    values = [448.0, -448.0, 1.0625, 1.1875, 272.0, 240.0, 2**-10, 3 * 2**-10, 2**-9, 7 * 2**-10,
              -1.0625, 0.0, 2**-6, 2**-7 + 2**-11]
    expected = [448.0, -448.0, 1.0, 1.25, 256.0, 240.0, 0.0, 2**-8, 2**-9, 2**-7,
                -1.0, 0.0, 2**-6, 2**-7]
    x = torch.tensor(values + [0.0] * (16 - len(values))).reshape(1, 16)
    out = mf.Float8CurrentScalingQuantizer(E4M3)(x)
    assert out.quantized_storage.scale_inv.item() == 1.0
    got = out.dequantize()[0, : len(values)].tolist()
    assert got == expected
    assert torch.equal(as_bytes(out.quantized_storage.data), as_bytes(torch_fp8(x, E4M3)))


def test_per_tensor_e5m2_ties_and_max():
    values = [57344.0, -57344.0, 1.125, 1.375, 2**-16, 2**-17, 3 * 2**-17, 40960.0 + 4096.0]
    expected = [57344.0, -57344.0, 1.0, 1.5, 2**-16, 0.0, 2**-15, 49152.0]  # tie: even
    x = torch.tensor(values + [0.0] * (16 - len(values))).reshape(1, 16)
    out = mf.Float8CurrentScalingQuantizer(E5M2)(x)
    assert out.quantized_storage.scale_inv.item() == 1.0
    assert out.dequantize()[0, : len(values)].tolist() == expected


def test_mxfp8_ties_with_a_unit_scale():
    """Block amax 256: 256 * fp32(1/448) rounds up to 2^0, so elements are rounded as they are."""
    row = [256.0, 1.0625, 1.1875, 136.0, 2**-10, 3 * 2**-10, -1.0625, 0.0]
    x = torch.zeros(32, 32)
    x[0, :8] = torch.tensor(row)
    x[1, 1:8] = 256.0  # every column block holding a tie has amax 256 as well
    storage = mf.MXFP8Quantizer()(x).quantized_storage
    assert storage.rowwise_scale[0, 0].item() == 127 and storage.rowwise_scale[1, 0].item() == 127
    assert (storage.columnwise_scale[0, :8] == 127).all()
    expected = [256.0, 1.0, 1.25, 128.0, 0.0, 2**-8, -1.0, 0.0]
    assert storage.rowwise_data[0, :8].float().tolist() == expected
    assert storage.columnwise_data[0, :8].float().tolist() == expected


def test_nvfp4_ties_to_even():
    """Row 0 holds A = 2688 (S_enc = 1); row 1's block max 6 gives s_b = 1 exactly, so its
    elements are rounded as they are: ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the even
    code (0, 1, 1, 2, 2, 4, 4)."""
    x = torch.zeros(16, 16)
    x[0, 0] = 2688.0
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 4.0, 0.0, 0.1,
            -3.0]
    x[1] = torch.tensor(ties)
    storage = mf.NVFP4Quantizer(columnwise=False)(x).quantized_storage
    assert storage.rowwise_scale[1].float().item() == 1.0
    got = storage.dequantize()[1].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -2.0, -4.0, 4.0, 0.0, 0.0,
                   -3.0]
    codes = torch.stack((storage.rowwise_data[1] & 0xF, storage.rowwise_data[1] >> 4), -1)
    assert codes.reshape(-1)[8].item() == 0x8  # -0.25 -> -0 keeps the sign bit


@pytest.mark.parametrize("name", ["current_e4m3", "current_e5m2", "block_1d", "block_2d",
                                  "mxfp8", "nvfp4", "nvfp4_2d"])
def test_tiny_values(name):
    """amax far below 1 (fp32 subnormals included): scales overflow to their cap, no NaN/inf."""
    family = FAMILIES[name]
    x = family_input(family, seed=9) * 1e-39
    storage = _deq(name, x, (True, True))
    check_buffers(storage, family, x, True, True, family.expected(x))
    values = storage.dequantize()
    assert torch.isfinite(values).all()
    assert (values.abs() <= x.abs().max() * 1.5).all()


@pytest.mark.parametrize(
    "dtype, power_2, expected_scale",
    [
        (torch.float32, True, 2.0**127),  # FLT_MAX rounded down to a power of two
        (torch.float32, False, float(torch.finfo(torch.float32).max)),
        (torch.bfloat16, False, float(torch.finfo(torch.bfloat16).max)),
    ],
)
def test_block_fp8_scale_overflow_takes_the_input_dtype_max(dtype, power_2, expected_scale):
    """448 / 1e-39 overflows fp32: the scale becomes the input dtype's max (NUMERICS.md §4)."""
    x = torch.full((1, 128), 1e-39).to(dtype)
    storage = mf.Float8BlockQuantizer(1, power_2_scale=power_2)(x).quantized_storage
    scale = torch.tensor(expected_scale, dtype=torch.float32)
    assert storage.rowwise_scale_inv.item() == (1 / scale).item()
    expected = torch_fp8(x.float() * scale, E4M3)
    assert torch.equal(as_bytes(storage.rowwise_data), as_bytes(expected))
    assert torch.isfinite(storage.dequantize()).all()


# --------------------------------------------------------------------------------------------
# shapes the formats cannot hold, and partial blocks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(30, 64), (32, 48), (2, 15, 64), (64,), (16, 16)], ids=str)
def test_mxfp8_needs_multiples_of_32(shape):
    q = mf.MXFP8Quantizer()
    with pytest.raises(ValueError, match=r"multiples of 32"):
        q(torch.randn(shape))
    with pytest.raises(ValueError, match="32"):
        q.make_empty(shape)


@pytest.mark.parametrize("shape", [(16, 24), (8, 32), (2, 4, 32), (32,)], ids=str)
@pytest.mark.parametrize("options", [{}, {"with_rht": True}, {"with_2d_quantization": True},
                                     {"stochastic_rounding": True}], ids=["1d", "rht", "2d", "sr"])
def test_nvfp4_needs_multiples_of_16(shape, options):
    q = mf.NVFP4Quantizer(**options)
    with pytest.raises(ValueError, match=r"multiples of 16"):
        q(torch.randn(shape))


@pytest.mark.parametrize("shape", [(100, 200), (3, 130), (1, 5), (129, 1), (2, 3, 131)], ids=str)
@pytest.mark.parametrize("dim", [1, 2])
def test_block_fp8_accepts_partial_blocks(shape, dim):
    name = f"block_{dim}d"
    family = FAMILIES[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(10)) * 3
    out = family.quantize(x)
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x))
    x2d = x.reshape(-1, shape[-1])
    rows = 128 if dim == 2 else 1
    data, scale_inv = plain_block_fp8(x2d, rows)
    storage = out.quantized_storage
    assert torch.equal(as_bytes(storage.rowwise_data), as_bytes(data))
    assert torch.equal(storage.rowwise_scale_inv, scale_inv)
    values = out.dequantize()
    assert values.shape == x.shape
    for direction in ("rowwise", "columnwise"):
        bound = elementwise_bound(name, x2d, direction)
        assert ((values.reshape(x2d.shape) - x2d).abs() <= bound).all()


@pytest.mark.parametrize("shape", [(3, 5), (1, 1), (7,), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("name", ["current_e4m3", "delayed_e4m3", "identity"])
def test_per_tensor_accepts_any_shape(name, shape):
    family = FAMILIES[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    out = family.quantize(x)
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x))
    assert out.dequantize().shape == x.shape


# --------------------------------------------------------------------------------------------
# 0-dim tensors, wrong dtypes, wrong types
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_zero_dim_tensor_is_rejected(name):
    q = FAMILIES[name].quantizer()
    with pytest.raises(ValueError, match="0-dim"):
        q(torch.tensor(1.5))
    with pytest.raises(ValueError, match="0-dim"):
        q.make_empty(())
    assert q.is_quantizable(torch.tensor(1.5)) is False


@pytest.mark.parametrize(
    "dtype",
    [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64,
     torch.complex64, torch.float8_e4m3fn],
)
@pytest.mark.parametrize("name", ALL)
def test_unsupported_dtypes_are_rejected(name, dtype):
    family = FAMILIES[name]
    x = torch.ones(family.shape).to(dtype)
    with pytest.raises(TypeError, match=r"float32, bfloat16 or float16") as info:
        family.quantizer()(x)
    assert str(dtype) in str(info.value)


@pytest.mark.parametrize("name", ALL)
def test_non_tensor_input_is_rejected(name):
    with pytest.raises(TypeError, match="torch.Tensor"):
        FAMILIES[name].quantizer()([[1.0, 2.0]])


@pytest.mark.parametrize("name", ALL)
def test_float16_input(name):
    family = FAMILIES[name]
    x = family_input(family, seed=12).to(torch.float16)
    out = family.quantize(x)
    assert out.dtype == torch.float16 and out.dequantize().dtype == torch.float16
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x))
