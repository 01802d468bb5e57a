"""Quantizer usages (rowwise / columnwise / both), update_usage per NUMERICS.md §9, flags.

This module also holds the family table and the reference helpers that the other test modules of
this package import (`from .test_usages import ...`). Two kinds of reference are used:

- `numerics_reference`: the numerics functions called directly, composed the way NUMERICS.md
  describes each family (e.g. the per-tensor columnwise copy is the byte transpose of the rowwise
  data; the MXFP8 columnwise copy is a separate columnwise quantization).
- `plain_*` helpers: an independent re-derivation of the formats from NUMERICS.md written here in
  plain torch (torch's own saturating-by-clamp float8 conversion, frexp for powers of two, a
  threshold table for E2M1 with ties to even). They never call minifloat.numerics."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat import numerics

from .cases import (
    ALL,
    DELAYED_SCALE,
    DETERMINISTIC,
    E4M3,
    E5M2,
    FAMILIES,
    REQUANTIZE_MESSAGE,
    USAGE_IDS,
    USAGES,
    as_bytes,
    assert_same_bytes,
    check_buffers,
    family_input,
    plain_block_fp8,
    plain_mxfp8,
    plain_nvfp4,
    plain_per_tensor,
)


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_requested_buffers_match_numerics_reference(name, usage):
    family = FAMILIES[name]
    rowwise, columnwise = usage
    x = family_input(family)
    out = family.quantize(x, rowwise, columnwise)
    assert isinstance(out, mf.QuantizedTensor)
    storage = out.quantized_storage
    assert storage.has_rowwise() == rowwise and storage.has_columnwise() == columnwise
    check_buffers(storage, family, x, rowwise, columnwise, family.expected(x, rowwise, columnwise))


@pytest.mark.parametrize("name", ALL)
def test_leading_dims_buffers_are_laid_out_over_the_2d_view(name):
    family = FAMILIES[name]
    x = family_input(family, family.leading_shape, seed=3)
    out = family.quantize(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x, True, True))


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_bfloat16_input_keeps_nominal_dtype_and_matches_reference(name):
    family = FAMILIES[name]
    x = family_input(family, dtype=torch.bfloat16, seed=5)
    out = family.quantize(x)
    assert out.dtype == torch.bfloat16
    assert out.dequantize().dtype == torch.bfloat16
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x, True, True))


# ---- independent plain-torch re-derivations of each format ----


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_current_scaling_bytes_equal_plain_torch_cast(dtype):
    # amax = 8 (a power of two), so fp8_max / amax is exact whichever way it is computed; see
    # test_current_scaling_scale_is_one_fp32_division for an amax where that matters
    x = (torch.randn(48, 80, generator=torch.Generator().manual_seed(7)) * 3).clamp(-7.9, 7.9)
    x[5, 7] = -8.0
    out = mf.Float8CurrentScalingQuantizer(dtype)(x).quantized_storage
    data, scale_inv = plain_per_tensor(x, dtype)
    assert_same_bytes(out.data, data, "data")
    assert_same_bytes(out.data_transpose, data.t().contiguous(), "data_transpose")
    assert_same_bytes(out.scale_inv, scale_inv, "scale_inv")


def test_delayed_scaling_bytes_equal_plain_torch_cast_with_state_scale():
    x = torch.randn(48, 80, generator=torch.Generator().manual_seed(8))
    scale = torch.tensor([DELAYED_SCALE])
    out = mf.Float8Quantizer(scale, torch.zeros(1))(x).quantized_storage
    data, scale_inv = plain_per_tensor(x, E4M3, scale)
    assert_same_bytes(out.data, data, "data")
    assert_same_bytes(out.data_transpose, data.t().contiguous(), "data_transpose")
    assert out.scale_inv.item() == 1.0 / DELAYED_SCALE


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130)])
def test_block_1d_bytes_equal_plain_torch(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 5
    out = mf.Float8BlockQuantizer(1)(x).quantized_storage
    data, scale_inv = plain_block_fp8(x, 1)
    assert_same_bytes(out.rowwise_data, data, "rowwise_data")
    assert_same_bytes(out.rowwise_scale_inv, scale_inv, "rowwise_scale_inv")
    data_t, scale_inv_t = plain_block_fp8(x.t(), 1)
    assert_same_bytes(out.columnwise_data, data_t, "columnwise_data")
    assert_same_bytes(out.columnwise_scale_inv, scale_inv_t, "columnwise_scale_inv")


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_block_2d_bytes_equal_plain_torch(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(10)) * 5
    out = mf.Float8BlockQuantizer(2)(x).quantized_storage
    data, scale_inv = plain_block_fp8(x, 128)
    assert_same_bytes(out.rowwise_data, data, "rowwise_data")
    assert_same_bytes(out.rowwise_scale_inv, scale_inv, "rowwise_scale_inv")
    assert_same_bytes(out.columnwise_data, data.t().contiguous(), "columnwise_data")
    assert_same_bytes(out.columnwise_scale_inv, scale_inv.t().contiguous(), "columnwise_scale")


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_mxfp8_bytes_equal_plain_torch(dtype):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(11))
    x[:32] *= 1000.0  # blocks with very different exponents
    out = mf.MXFP8Quantizer(dtype)(x).quantized_storage
    data, exps = plain_mxfp8(x, 1, 32, dtype)
    assert_same_bytes(out.rowwise_data, data, "rowwise_data")
    assert_same_bytes(out.rowwise_scale, exps, "rowwise_scale")
    data_c, exps_c = plain_mxfp8(x, 32, 1, dtype)
    assert_same_bytes(out.columnwise_data, data_c, "columnwise_data")
    assert_same_bytes(out.columnwise_scale, exps_c, "columnwise_scale")


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
def test_nvfp4_bytes_equal_plain_torch(two_d):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(12)).clamp(-3, 3)
    x[:, :16] *= 50.0
    x[7, 3] = 256.0  # A = 256: S_enc = 2688 / 256 = 10.5 exactly
    out = mf.NVFP4Quantizer(with_2d_quantization=two_d)(x).quantized_storage
    tile_rows = 16 if two_d else 1
    data, scale, amax = plain_nvfp4(x, tile_rows=tile_rows)
    assert_same_bytes(out.rowwise_data, data, "rowwise_data")
    assert_same_bytes(out.rowwise_scale, scale, "rowwise_scale")
    assert_same_bytes(out.amax_rowwise, amax, "amax_rowwise")
    data_t, scale_t, amax_t = plain_nvfp4(x.t(), tile_rows=tile_rows)
    assert_same_bytes(out.columnwise_data, data_t, "columnwise_data")
    assert_same_bytes(out.columnwise_scale, scale_t, "columnwise_scale")
    assert_same_bytes(out.amax_columnwise, amax_t, "amax_columnwise")


def test_nvfp4_rht_columnwise_quantizes_the_transformed_transpose():
    """Columnwise copy = NVFP4 of RHT(x^T) with amax taken after the RHT; rowwise has no RHT."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(13)) * 0.5
    # A column holding the sign vector s over rows 0..15 transforms to [4, 0, ..., 0] exactly
    # (s diag(s) H16 / 4 = 1 H16 / 4), so the columnwise amax is 4 and S_enc = 672 exactly.
    x[0:16, 0] = torch.tensor(numerics.RHT_SIGNS, dtype=torch.float32)
    x[20, 5] = 4.0  # rowwise amax 4 as well
    out = mf.NVFP4Quantizer(with_rht=True)(x).quantized_storage
    transformed = numerics.random_hadamard_transform(x.t().contiguous())
    assert transformed.dtype == torch.bfloat16
    data_t, scale_t, amax_t = plain_nvfp4(transformed)
    assert_same_bytes(out.columnwise_data, data_t, "columnwise_data")
    assert_same_bytes(out.columnwise_scale, scale_t, "columnwise_scale")
    assert_same_bytes(out.amax_columnwise, amax_t, "amax_columnwise")
    assert out.amax_columnwise.item() == 4.0
    data, scale, amax = plain_nvfp4(x)
    assert_same_bytes(out.rowwise_data, data, "rowwise_data")
    assert_same_bytes(out.amax_rowwise, amax, "amax_rowwise")
    # RHT is orthonormal per 16-run: an independent matrix form agrees to bf16 rounding
    h = torch.tensor([[1.0]])
    while h.shape[0] < 16:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.tensor(numerics.RHT_SIGNS, dtype=torch.float32)
    matrix = torch.diag(signs) @ h / 4
    by_matrix = (x.t().reshape(96, 4, 16) @ matrix).reshape(96, 64)
    torch.testing.assert_close(transformed.float(), by_matrix, atol=0.02, rtol=2**-7)


# Regression: `python_float / tensor` is evaluated by torch as reciprocal(tensor) * float (two
# roundings), not the single fp32 division NUMERICS.md §2 step 3 and §6 specify.


def test_current_scaling_scale_is_one_fp32_division():
    x = torch.tensor([[3.0, 1.0, -0.3, 2.2] * 4] * 2)  # amax 3: 448 / 3 rounds differently
    out = mf.Float8CurrentScalingQuantizer()(x).quantized_storage
    scale = torch.tensor(448.0) / torch.tensor(3.0)  # IEEE fp32 division
    assert scale.item() == 149.3333282470703
    assert_same_bytes(out.scale_inv, (1.0 / scale).reshape(1), "scale_inv")


def test_block_scale_without_power_of_two_is_one_fp32_division():
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    out = mf.Float8BlockQuantizer(1, power_2_scale=False)(x).quantized_storage
    scale = torch.tensor(448.0) / x.abs().reshape(128, 2, 128).amax(-1)
    assert_same_bytes(out.rowwise_scale_inv, 1.0 / scale, "rowwise_scale_inv")


def test_nvfp4_global_encode_scale_is_one_fp32_division():
    # bf16-valued inputs land on E2M1 rounding ties often, so a 1-ulp S_enc shows in the bytes
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).clamp(-4.95, 4.95)
    x = x.bfloat16().float()
    x[3, 3] = 5.0  # A = 5: 2688 / 5 is 537.59998 by division, 537.60004 by reciprocal-multiply
    out = mf.NVFP4Quantizer(columnwise=False)(x).quantized_storage
    data, scale, _ = plain_nvfp4(x)
    assert_same_bytes(out.rowwise_scale, scale, "rowwise_scale")
    assert_same_bytes(out.rowwise_data, data, "rowwise_data")


@pytest.mark.parametrize("seed", range(12))
def test_scales_from_arbitrary_amax_equal_plain_torch(seed):
    """Random (non power-of-two) amaxes, beside the directed cases above: reciprocal-multiply is
    off by an ulp for roughly 1 amax in 4 (among these draws, seed 1 exposes it in the
    per-tensor scale_inv bytes)."""
    gen = torch.Generator().manual_seed(100 + seed)
    # bf16-valued elements (they often sit on rounding ties once scaled) and an fp32 amax with a
    # full 24-bit mantissa (bf16-valued amaxes are often powers of two here)
    x = (torch.randn(32, 64, generator=gen) * 3).bfloat16().float()
    x[0, 0] = x.abs().max() * (1 + torch.rand((), generator=gen))
    for dtype in (E4M3, E5M2):
        out = mf.Float8CurrentScalingQuantizer(dtype)(x).quantized_storage
        data, scale_inv = plain_per_tensor(x, dtype)
        assert_same_bytes(out.scale_inv, scale_inv, "scale_inv")
        assert_same_bytes(out.data, data, "data")
    out = mf.NVFP4Quantizer()(x).quantized_storage
    for prefix, source in (("rowwise", x), ("columnwise", x.t())):
        data, scale, amax = plain_nvfp4(source)
        assert_same_bytes(getattr(out, f"{prefix}_data"), data, f"{prefix}_data")
        assert_same_bytes(getattr(out, f"{prefix}_scale"), scale, f"{prefix}_scale")


def test_identity_holds_the_values_themselves():
    x = torch.randn(8, 24)
    out = mf.IdentityQuantizer()(x).quantized_storage
    assert torch.equal(out.rowwise_data, x) and torch.equal(out.columnwise_data, x)
    cast = mf.IdentityQuantizer(torch.bfloat16)(x)
    assert cast.dtype == torch.bfloat16
    assert torch.equal(cast.quantized_storage.rowwise_data, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        mf.IdentityQuantizer(torch.int8)


# ---- set_usage ----


@pytest.mark.parametrize("name", ALL)
def test_set_usage_none_leaves_each_direction_unchanged(name):
    q = FAMILIES[name].quantizer(rowwise=True, columnwise=False)
    q.set_usage()
    assert (q.rowwise_usage, q.columnwise_usage) == (True, False)
    q.set_usage(rowwise=None, columnwise=True)
    assert (q.rowwise_usage, q.columnwise_usage) == (True, True)
    q.set_usage(rowwise=False)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    q.set_usage(columnwise=None)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)


@pytest.mark.parametrize("name", ALL)
def test_quantizer_with_neither_usage_raises(name):
    family = FAMILIES[name]
    x = family_input(family)
    q = family.quantizer(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="neither rowwise nor columnwise"):
        q(x)
    q = family.quantizer()
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="set_usage"):
        q.quantize(x)


@pytest.mark.parametrize("name", ALL)
def test_set_usage_changes_what_the_next_call_quantizes(name):
    family = FAMILIES[name]
    x = family_input(family)
    q = family.quantizer()
    q.set_usage(columnwise=False)
    if family.stochastic:
        torch.manual_seed(1234)
    storage = q(x).quantized_storage
    check_buffers(storage, family, x, True, False, family.expected(x, True, False))


# ---- internal flag ----


@pytest.mark.parametrize("name", ALL)
def test_internal_returns_bare_storage(name):
    family = FAMILIES[name]
    x = family_input(family)
    bare = family.quantize(x, internal=True)
    assert isinstance(bare, family.storage_class)
    assert not isinstance(bare, torch.Tensor)
    assert bare.size() == x.shape and bare.size(-1) == x.shape[-1]
    assert bare.device == x.device
    check_buffers(bare, family, x, True, True, family.expected(x))
    wrapped = family.quantize(x, internal=False)
    assert isinstance(wrapped, mf.QuantizedTensor)
    assert type(wrapped.quantized_storage) is family.storage_class


# --------------------------------------------------------------------------------------------
# tests: update_usage (NUMERICS.md §9)
# --------------------------------------------------------------------------------------------


def _snapshot(storage, names):
    buffers = {n: getattr(storage, n) for n in names}
    return {n: as_bytes(b).clone() for n, b in buffers.items() if b is not None}


@pytest.mark.parametrize("drop", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", ALL)
def test_dropping_one_copy_keeps_the_other_untouched(name, drop):
    family = FAMILIES[name]
    x = family_input(family)
    storage = family.quantize(x, internal=True)
    keep_fields = family.col_fields if drop == "rowwise" else family.row_fields
    before = _snapshot(storage, keep_fields + family.shared_fields)
    storage.update_usage(**{drop: False})
    dropped = family.row_fields if drop == "rowwise" else family.col_fields
    assert all(getattr(storage, n) is None for n in dropped)
    for n, b in before.items():
        assert torch.equal(as_bytes(getattr(storage, n)), b), n
    assert storage.has_rowwise() == (drop != "rowwise")
    assert storage.has_columnwise() == (drop != "columnwise")
    # dropping the copy that is already gone, or keeping what is there, is a no-op
    storage.update_usage(**{drop: False})
    storage.update_usage()


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_dropping_both_copies_is_an_error_and_changes_nothing(name, usage):
    family = FAMILIES[name]
    x = family_input(family)
    storage = family.quantize(x, *usage, internal=True)
    before = _snapshot(storage, storage.tensor_fields())
    with pytest.raises(ValueError, match="both"):
        storage.update_usage(rowwise=False, columnwise=False)
    only = "rowwise" if usage == (True, False) else "columnwise" if usage == (False, True) else None
    if only:  # dropping the only copy there is
        with pytest.raises(ValueError):
            storage.update_usage(**{only: False})
    after = _snapshot(storage, storage.tensor_fields())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


DERIVABLE = [n for n, f in FAMILIES.items() if f.derivable]
NOT_DERIVABLE = [n for n, f in FAMILIES.items() if not f.derivable]


@pytest.mark.parametrize("direction", ["columnwise", "rowwise"])
@pytest.mark.parametrize("name", DERIVABLE)
def test_derivable_copy_equals_fresh_quantization(name, direction):
    family = FAMILIES[name]
    x = family_input(family, family.leading_shape if name == "identity" else None, seed=21)
    start = (True, False) if direction == "columnwise" else (False, True)
    storage = family.quantize(x, *start, internal=True)
    storage.update_usage(**{direction: True})
    assert storage.has_rowwise() and storage.has_columnwise()
    fresh = family.expected(x, direction == "rowwise", direction == "columnwise")
    fields = family.col_fields if direction == "columnwise" else family.row_fields
    for n in fields:
        assert_same_bytes(getattr(storage, n), fresh[n], f"derived {n}")
    # and it is a genuine quantizer result: equal to the quantizer's own fresh call
    direct = family.quantize(x, direction == "rowwise", direction == "columnwise", internal=True)
    for n in fields:
        assert_same_bytes(getattr(storage, n), getattr(direct, n), f"derived {n} vs quantizer")


@pytest.mark.parametrize("name", DERIVABLE)
def test_derive_then_drop_swaps_the_copy(name):
    family = FAMILIES[name]
    x = family_input(family, seed=22)
    storage = family.quantize(x, True, False, internal=True)
    values = storage.dequantize()
    storage.update_usage(rowwise=False, columnwise=True)
    assert not storage.has_rowwise() and storage.has_columnwise()
    assert torch.equal(storage.dequantize(), values)
    fresh = family.expected(x, False, True)
    for n in family.col_fields:
        assert_same_bytes(getattr(storage, n), fresh[n], n)


@pytest.mark.parametrize("direction", ["columnwise", "rowwise"])
@pytest.mark.parametrize("name", NOT_DERIVABLE)
def test_underivable_copy_raises_and_keeps_the_storage(name, direction):
    family = FAMILIES[name]
    x = family_input(family, seed=23)
    start = (True, False) if direction == "columnwise" else (False, True)
    storage = family.quantize(x, *start, internal=True)
    before = _snapshot(storage, storage.tensor_fields())
    with pytest.raises(ValueError) as info:
        storage.update_usage(**{direction: True})
    message = str(info.value)
    assert REQUANTIZE_MESSAGE.search(message), message
    assert direction in message
    # also when the call would drop the copy it has
    other = "rowwise" if direction == "columnwise" else "columnwise"
    with pytest.raises(ValueError, match=REQUANTIZE_MESSAGE):
        storage.update_usage(**{direction: True, other: False})
    after = _snapshot(storage, storage.tensor_fields())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert storage.has_rowwise() == start[0] and storage.has_columnwise() == start[1]


# --------------------------------------------------------------------------------------------
# tests: is_requantization_safe, is_quantizable
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_is_requantization_safe_false_only_with_stochastic_rounding(name):
    family = FAMILIES[name]
    q = family.quantizer()
    assert q.is_requantization_safe() is (not family.stochastic)
    x = family_input(family, seed=31)
    a = q(x).quantized_storage
    b = q(x).quantized_storage
    same = all(
        torch.equal(as_bytes(getattr(a, n)), as_bytes(getattr(b, n)))
        for n in a.tensor_fields()
    )
    # the claim is true: deterministic families give equal bytes twice, SR does not
    assert same is (not family.stochastic)


def test_stochastic_rounding_flag_combinations():
    assert not mf.NVFP4Quantizer(stochastic_rounding=True, with_rht=True).is_requantization_safe()
    assert mf.NVFP4Quantizer(with_rht=True).is_requantization_safe()
    assert mf.NVFP4Quantizer(with_2d_quantization=True).is_requantization_safe()
    with pytest.raises(ValueError, match="RHT"):
        mf.NVFP4Quantizer(with_rht=True, with_2d_quantization=True)


QUANTIZABLE_CASES = {
    # shape: (per-tensor/block/identity, mxfp8, nvfp4)
    (64, 128): (True, True, True),
    (2, 16, 64): (True, True, True),
    (2, 8, 32): (True, False, True),
    (30, 64): (True, False, False),
    (32, 48): (True, False, True),
    (16, 24): (True, False, False),
    (8, 32): (True, False, False),
    (100, 200): (True, False, False),
    (64,): (True, False, False),
    (): (False, False, False),
}


@pytest.mark.parametrize("shape", list(QUANTIZABLE_CASES), ids=str)
@pytest.mark.parametrize("name", ALL)
def test_is_quantizable(name, shape):
    family = FAMILIES[name]
    plain, mx, nv = QUANTIZABLE_CASES[shape]
    want = mx if family.block == 32 else nv if family.block == 16 else plain
    x = torch.randn(shape)
    assert family.quantizer().is_quantizable(x) is want
    if want:
        out = family.quantize(x)
        assert out.shape == x.shape
    else:
        with pytest.raises(ValueError):
            family.quantize(x)
