"""QuantizedStorage behaviour: dequantize (values, error bounds, direction preference), saving for
backward, quantizer copy(), make_empty, update_quantized, and delayed-scaling state."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

from .cases import (
    ALL,
    DELAYED_SCALE,
    E2M1_GRID,
    E4M3,
    E5M2,
    FAMILIES,
    USAGE_IDS,
    USAGES,
    _spread,
    _tile_absmax,
    as_bytes,
    assert_same_bytes,
    check_buffers,
    family_input,
    plain_e2m1_decode,
    plain_per_tensor,
)

# --------------------------------------------------------------------------------------------
# plain decoders (written from NUMERICS.md, no minifloat.numerics inside)
# --------------------------------------------------------------------------------------------


def pow2_input(family, shape=None, seed=0, amax=4.0):
    """Gaussian data whose absolute max is exactly `amax` (a power of two), so per-tensor and
    NVFP4 global scales are exact quotients however they are computed (the plain decoders here
    need S_dec; test_usages checks the fp32 division itself)."""
    x = family_input(family, shape, seed).clamp(-0.97 * amax, 0.97 * amax)
    x.view(-1)[7] = -amax
    return x


def plain_decode(storage, direction: str) -> torch.Tensor:
    """Dequantize one direction's buffers into the [M, K] layout of the logical tensor."""
    if isinstance(storage, mf.Float8Storage):
        data = storage.data if direction == "rowwise" else storage.data_transpose.t()
        return data.float() * storage.scale_inv
    if isinstance(storage, mf.Float8BlockStorage):
        data, scale_inv = (
            (storage.rowwise_data, storage.rowwise_scale_inv)
            if direction == "rowwise"
            else (storage.columnwise_data, storage.columnwise_scale_inv)
        )
        rows = 128 if storage.block_scaling_dim == 2 else 1
        values = data.float() * _spread(scale_inv, rows, 128, data.shape)
        return values if direction == "rowwise" else values.t()
    if isinstance(storage, mf.MXFP8Storage):
        if direction == "rowwise":
            data, exps, rows, cols = storage.rowwise_data, storage.rowwise_scale, 1, 32
        else:
            data, exps, rows, cols = storage.columnwise_data, storage.columnwise_scale, 32, 1
        decode = torch.ldexp(torch.ones(exps.shape), exps.to(torch.int32) - 127)
        return data.float() * _spread(decode, rows, cols, data.shape)
    if isinstance(storage, mf.NVFP4Storage):
        data, scale, amax = (
            (storage.rowwise_data, storage.rowwise_scale, storage.amax_rowwise)
            if direction == "rowwise"
            else (storage.columnwise_data, storage.columnwise_scale, storage.amax_columnwise)
        )
        s_dec = 1.0 / (torch.tensor(2688.0) / amax)
        q = plain_e2m1_decode(data)
        values = (q * scale.float().repeat_interleave(16, 1)) * s_dec
        return values if direction == "rowwise" else values.t()
    if isinstance(storage, mf.IdentityStorage):
        return (storage.rowwise_data if direction == "rowwise" else storage.columnwise_data).float()
    raise AssertionError(type(storage))


def plain_inverse_rht(y2d: torch.Tensor) -> torch.Tensor:
    """Undo the RHT on every 16-run along the last dim: y @ (diag(s) H16 / 4)^-1, where the
    inverse is the transpose H16 diag(s) / 4 (H16 symmetric, rows orthogonal with norm 4)."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < 16:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.tensor(mf.numerics.RHT_SIGNS, dtype=torch.float32)
    inverse = h @ torch.diag(signs) / 4
    rows, cols = y2d.shape
    return (y2d.reshape(rows, cols // 16, 16) @ inverse).reshape(rows, cols)


# --------------------------------------------------------------------------------------------
# error bounds (hand-derived, see each branch)
# --------------------------------------------------------------------------------------------

# relative Frobenius error ceilings for N(0, 1) data. Measured on 256x512 gaussians: E4M3
# formats 0.027, E5M2 0.053, NVFP4 1D 0.095, NVFP4 2D 0.111 (larger tiles, smaller scales for
# most elements), NVFP4 SR 0.138 (SR has twice the per-element variance of RNE). A uniform
# error of half an ulp with 3 mantissa bits gives ~2^-4/sqrt(3)*E[1/m] ~ 0.03 for E4M3; the
# ceilings leave ~25% headroom for the smaller test tensors.
FROBENIUS = {
    "delayed_e4m3": 0.035, "current_e4m3": 0.035, "current_e5m2": 0.07,
    "block_1d": 0.035, "block_2d": 0.035, "mxfp8": 0.035, "mxfp8_e5m2": 0.07,
    "nvfp4": 0.12, "nvfp4_rht": 0.12, "nvfp4_sr": 0.17, "nvfp4_2d": 0.135, "identity": 0.0,
}


def elementwise_bound(name: str, x2d: torch.Tensor, direction: str) -> torch.Tensor | None:
    """Largest |dequantized - x| each element may show, from the format's grid spacing.

    FP8 with m mantissa bits: a normal value is off by at most half an ulp, 2^-(m+1) relative;
    below the smallest normal the grid is uniform with quantum 2^-9 (E4M3) / 2^-16 (E5M2) in
    scaled units, so the absolute error is at most half of that times the decode scale.
    Block formats bound the decode scale by the block amax: power-of-two scales round the encode
    scale down (block FP8) or the decode scale up (MXFP8), by less than 2x, so
    decode <= 2 * block_amax / fp8_max. NVFP4: E2M1 has one mantissa bit (half ulp = 25% for
    |v| >= 1, 0.25 absolute below), in units of s_b * S_dec <= block_amax / 6 * (1 + 2^-4)
    (UE4M3 rounding); saturation of the block max (v <= 6 / (1 - 2^-4)) stays inside 25%.
    Stochastic rounding may go to the farther neighbour: one full gap, twice the RNE bound.
    """
    ax = x2d.abs()
    slack = 1e-6 * ax + 1e-30
    family = FAMILIES[name]
    if name in ("delayed_e4m3", "current_e4m3", "current_e5m2"):
        fmax = 57344.0 if name == "current_e5m2" else 448.0
        rel, half_sub = (2**-3, 2**-17) if name == "current_e5m2" else (2**-4, 2**-10)
        decode = 1.0 / DELAYED_SCALE if name == "delayed_e4m3" else ax.max() / fmax
        return rel * ax + half_sub * decode * 1.0001 + slack
    if name == "identity":
        return torch.zeros_like(ax)
    if name in ("block_1d", "block_2d"):
        if name == "block_2d":
            shape = (128, 128)
        else:
            shape = (1, 128) if direction == "rowwise" else (128, 1)
        bamax = _spread(_tile_absmax(x2d, *shape), *shape, x2d.shape)
        return 2**-4 * ax + 2**-10 * 2 * bamax / 448 + slack
    if name.startswith("mxfp8"):
        shape = (1, 32) if direction == "rowwise" else (32, 1)
        bamax = _spread(_tile_absmax(x2d, *shape), *shape, x2d.shape)
        if name == "mxfp8_e5m2":
            return 2**-3 * ax + 2**-17 * 2 * bamax / 57344 + slack
        return 2**-4 * ax + 2**-10 * 2 * bamax / 448 + slack
    if name.startswith("nvfp4"):
        if family.tags & {"rht"} and direction == "columnwise":
            return None  # errors are mixed across each 16-run by the inverse transform
        shape = (16, 16) if name == "nvfp4_2d" else (1, 16) if direction == "rowwise" else (16, 1)
        bamax = _spread(_tile_absmax(x2d, *shape), *shape, x2d.shape)
        factor = 0.5 if family.stochastic else 0.25
        return factor * ax + factor * bamax / 6 * (1 + 2**-4) + slack
    raise AssertionError(name)


# --------------------------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_dequantize_equals_plain_decode_of_the_preferred_copy(name, usage):
    family = FAMILIES[name]
    x = pow2_input(family)
    storage = family.quantize(x, *usage, internal=True)
    values = storage.dequantize()
    assert values.shape == x.shape and values.dtype == x.dtype
    direction = "rowwise" if usage[0] else "columnwise"  # rowwise preferred when both exist
    expected = plain_decode(storage, direction)
    if family.tags & {"rht"} and direction == "columnwise":
        expected = plain_inverse_rht(expected.t()).t()
        torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
        return
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if not f.same_values])
def test_dequantize_prefers_rowwise_when_directions_differ(name):
    family = FAMILIES[name]
    x = family_input(family, seed=41)
    # rows spanning 2^-24..2^24: a 32-row column block covers ~24 binades, more than the
    # normal range under E5M2's or E4M3's block max, so some elements go subnormal in the
    # columnwise copy but not in their own row's block (power-of-two scaling is otherwise
    # value-preserving for the relative rounding of FP8)
    x = x * torch.logspace(-24, 24, x.shape[0], base=2.0)[:, None]
    both = family.quantize(x, True, True, internal=True).dequantize()
    row = family.quantize(x, True, False, internal=True).dequantize()
    col = family.quantize(x, False, True, internal=True, seed=999).dequantize()
    assert torch.equal(both, row)
    assert not torch.equal(both, col), "the two copies should differ for these formats"


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.same_values])
def test_columnwise_only_dequantize_equals_rowwise_only(name):
    family = FAMILIES[name]
    for shape in (family.shape, family.leading_shape):
        x = family_input(family, shape, seed=42)
        row = family.quantize(x, True, False, internal=True).dequantize()
        col = family.quantize(x, False, True, internal=True).dequantize()
        assert col.shape == x.shape
        assert torch.equal(row, col)


def test_nvfp4_rht_columnwise_dequantize_inverts_the_transform():
    """Columnwise-only RHT dequantize = inverse RHT of the decoded x^T copy (close to x)."""
    family = FAMILIES["nvfp4_rht"]
    x = family_input(family, seed=43)
    storage = family.quantize(x, False, True, internal=True)
    decoded_t = plain_decode(storage, "columnwise").t()  # RHT(x^T) domain, [K, M]
    expected = plain_inverse_rht(decoded_t).t()
    values = storage.dequantize()
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    assert ((values - x).norm() / x.norm()).item() < FROBENIUS["nvfp4_rht"]


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", ALL)
def test_dequantize_error_bounds(name, direction):
    family = FAMILIES[name]
    x = family_input(family, seed=44)
    x2d = x.reshape(-1, x.shape[-1])
    storage = family.quantize(x, direction == "rowwise", direction == "columnwise", internal=True)
    values = storage.dequantize().reshape(x2d.shape)
    err = (values - x2d).abs()
    bound = elementwise_bound(name, x2d, direction)
    if bound is not None:
        worst = (err - bound).max().item()
        assert worst <= 0, f"{name} {direction}: an element exceeds its bound by {worst}"
    rel = ((values - x2d).norm() / x2d.norm()).item()
    assert rel <= FROBENIUS[name], f"{name} {direction}: relative Frobenius error {rel}"
    if name != "identity":
        assert rel > FROBENIUS[name] / 20, f"{name}: suspiciously exact ({rel})"


@pytest.mark.parametrize("name", ALL)
def test_dequantize_leading_dims(name):
    family = FAMILIES[name]
    x = family_input(family, family.leading_shape, seed=45)
    out = family.quantize(x)
    values = out.dequantize()
    assert values.shape == x.shape
    flat = family.quantize(x.reshape(-1, x.shape[-1])).dequantize()
    assert torch.equal(values, flat.reshape(x.shape))
    x2d = x.reshape(-1, x.shape[-1])
    bound = elementwise_bound(name, x2d, "rowwise")
    assert ((values.reshape(x2d.shape) - x2d).abs() <= bound).all()


@pytest.mark.parametrize("name", ["mxfp8", "block_2d", "identity"])
def test_dequantize_to_bfloat16(name):
    """MXFP8 values are exact in bf16 (NUMERICS.md §5); so are block FP8 values with power-of-two
    scales (3 mantissa bits times a power of two)."""
    family = FAMILIES[name]
    x = family_input(family, seed=46)
    out = family.quantize(x)
    bf16 = out.dequantize(torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == x.shape
    if name == "identity":
        assert torch.equal(bf16, x.to(torch.bfloat16))
    else:
        assert torch.equal(bf16.float(), out.dequantize(torch.float32))


# --------------------------------------------------------------------------------------------
# prepare_for_saving / restore_from_saved
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_prepare_and_restore_round_trip(name, usage):
    family = FAMILIES[name]
    x = family_input(family, seed=51)
    storage = family.quantize(x, *usage, internal=True)
    names = storage.tensor_fields()
    originals = [getattr(storage, n) for n in names]
    expected = storage.dequantize()
    tensors, holder = storage.prepare_for_saving()
    assert holder is storage
    assert len(tensors) == len(names)
    assert all(t is o for t, o in zip(tensors, originals, strict=True))
    assert all(getattr(storage, n) is None for n in names)  # the holder keeps metadata only
    with pytest.raises(RuntimeError, match="no data"):
        storage.dequantize()
    extra = torch.ones(3)
    leftover = storage.restore_from_saved([*tensors, extra])
    assert len(leftover) == 1 and leftover[0] is extra
    assert all(getattr(storage, n) is o for n, o in zip(names, originals, strict=True))
    assert torch.equal(storage.dequantize(), expected)
    assert storage.has_rowwise() == usage[0] and storage.has_columnwise() == usage[1]


class _ScaleByQuantized(torch.autograd.Function):
    """y = x * w_hp; saves the quantized w through ctx.save_for_backward; dx = g * dequant(w)."""

    @staticmethod
    def forward(ctx, x, w_quantized):
        tensors, holder = w_quantized.prepare_for_saving()
        ctx.save_for_backward(*tensors)
        ctx.holder = holder
        ctx.buffers_dropped = all(getattr(holder, n) is None for n in holder.tensor_fields())
        return x * 3.0

    @staticmethod
    def backward(ctx, grad):
        holder = ctx.holder
        leftover = holder.restore_from_saved(list(ctx.saved_tensors))
        assert leftover == []
        return grad * holder.dequantize(grad.dtype), None


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "saved_tensor_hooks"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["storage", "tensor"])
@pytest.mark.parametrize("name", ALL)
def test_saving_through_autograd_function(name, wrapped, hooks):
    family = FAMILIES[name]
    w = family_input(family, seed=52)
    quantized = family.quantize(w, internal=not wrapped)
    expected = quantized.dequantize().clone()
    x = torch.randn(w.shape, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t.dtype)
        return t.clone()  # e.g. an offload copy: the buffers come back as new tensors

    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = _ScaleByQuantized.apply(x, quantized)
    else:
        y = _ScaleByQuantized.apply(x, quantized)
    assert y.grad_fn is not None
    g = torch.randn(w.shape)
    y.backward(g)
    assert torch.equal(x.grad, g * expected)
    storage = quantized.quantized_storage if wrapped else quantized
    assert storage.has_rowwise() and storage.has_columnwise()
    if hooks:
        n_present = sum(getattr(storage, n) is not None for n in storage.tensor_fields())
        assert len(packed) == n_present


# --------------------------------------------------------------------------------------------
# Quantizer.copy(), output quantizer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_copy_is_a_distinct_quantizer_with_the_same_configuration(name):
    family = FAMILIES[name]
    q = family.quantizer(rowwise=True, columnwise=False, internal=True)
    c = q.copy()
    assert c is not q and type(c) is type(q)
    assert c.__dict__.keys() == q.__dict__.keys()
    for key, value in q.__dict__.items():
        other = c.__dict__[key]
        if isinstance(value, torch.Tensor):
            assert other is value  # delayed-scaling state is shared, not copied (DESIGN §2)
        else:
            assert other == value, key
    c.set_usage(columnwise=True)
    c.internal = False
    assert q.columnwise_usage is False and q.internal is True


@pytest.mark.parametrize("name", ALL)
def test_output_quantizer_is_a_stripped_copy(name):
    family = FAMILIES[name]
    q = family.quantizer()
    out = q(family_input(family))
    assert out.quantizer is not q and type(out.quantizer) is type(q)
    assert out.quantizer.amax_reduction_group is None
    # configuration travels with the output
    for key, value in q.__dict__.items():
        if not isinstance(value, torch.Tensor):
            assert out.quantizer.__dict__[key] == value, key
    # later changes to the quantizer do not leak into an existing output
    q.set_usage(rowwise=False)
    assert out.quantizer.rowwise_usage is True


def test_delayed_copy_shares_the_recipe_state():
    scale, amax = torch.tensor([8.0]), torch.zeros(1)
    q = mf.Float8Quantizer(scale, amax)
    c = q.copy()
    c(torch.full((4, 16), 3.0))
    assert amax.item() == 3.0  # the copy recorded into the original's amax slot
    scale.fill_(16.0)
    out = c(torch.ones(4, 16)).quantized_storage
    assert out.scale_inv.item() == 1 / 16


# --------------------------------------------------------------------------------------------
# make_empty
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_make_empty(name, usage, dtype):
    family = FAMILIES[name]
    q = family.quantizer(*usage)
    for shape in (family.shape, family.leading_shape):
        empty = q.make_empty(shape, dtype=dtype)
        assert isinstance(empty, mf.QuantizedTensor)
        assert empty.shape == torch.Size(shape) and empty.dtype == dtype
        assert empty.device == torch.device("cpu")
        check_buffers(empty.quantized_storage, family, torch.empty(shape, dtype=dtype), *usage)
    q.internal = True
    bare = q.make_empty(family.shape, dtype=dtype, device="cpu")
    assert isinstance(bare, family.storage_class) and bare.size() == torch.Size(family.shape)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.block])
def test_make_empty_rejects_shapes_the_format_cannot_hold(name):
    family = FAMILIES[name]
    with pytest.raises(ValueError, match=str(family.block)):
        family.quantizer().make_empty((family.block + 8, 64))
    with pytest.raises(ValueError, match="0-dim"):
        family.quantizer().make_empty(())


def test_make_empty_leaves_the_delayed_amax_alone():
    amax = torch.tensor([5.0])
    mf.Float8Quantizer(torch.tensor([1.0]), amax).make_empty((8, 16))
    assert amax.item() == 5.0


# --------------------------------------------------------------------------------------------
# update_quantized
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("internal", [False, True], ids=["tensor", "storage"])
@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_update_quantized_in_place(name, usage, internal):
    family = FAMILIES[name]
    x_old = family_input(family, seed=61)
    x_new = family_input(family, seed=62) * 2.5
    dst = family.quantize(x_old, *usage, internal=internal)
    storage = dst if internal else dst.quantized_storage
    pointers = {
        n: getattr(storage, n).data_ptr()
        for n in storage.tensor_fields()
        if getattr(storage, n) is not None
    }
    q = family.quantizer()  # asks for both copies: dst's usages decide what is written
    if family.stochastic:
        torch.manual_seed(77)
    returned = q.update_quantized(x_new, dst)
    assert returned is dst
    for n, ptr in pointers.items():
        assert getattr(storage, n).data_ptr() == ptr, f"{n} was reallocated"
    check_buffers(storage, family, x_new, *usage, family.expected(x_new, *usage, seed=77))


@pytest.mark.parametrize("name", ALL)
def test_update_quantized_shape_mismatch(name):
    family = FAMILIES[name]
    dst = family.quantize(family_input(family))
    with pytest.raises(ValueError, match="shape"):
        family.quantizer().update_quantized(torch.randn(family.leading_shape), dst)


def test_identity_update_quantized_does_not_write_into_the_original_source():
    """Regression: the identity storage once held a view of the caller's tensor, so in-place
    updates of the quantized result wrote into the tensor that had been quantized."""
    x = torch.randn(8, 16)
    original = x.clone()
    dst = mf.IdentityQuantizer()(x)
    mf.IdentityQuantizer().update_quantized(torch.zeros(8, 16), dst)
    assert torch.equal(dst.dequantize(), torch.zeros(8, 16))
    assert torch.equal(x, original)
    dst.copy_(torch.ones(8, 16))
    assert torch.equal(x, original)
    x.mul_(2)  # and the other way round: the input changing later leaves the result alone
    assert torch.equal(dst.dequantize(), torch.ones(8, 16))


def test_update_quantized_delayed_uses_the_state_scale():
    scale, amax = torch.tensor([16.0]), torch.zeros(1)
    q = mf.Float8Quantizer(scale, amax)
    dst = q(torch.randn(32, 48))
    scale.fill_(40.0)  # the recipe state moved on
    x_new = torch.randn(32, 48, generator=torch.Generator().manual_seed(63))
    q.update_quantized(x_new, dst)
    data, scale_inv = plain_per_tensor(x_new, E4M3, torch.tensor(40.0))
    storage = dst.quantized_storage
    assert_same_bytes(storage.data, data, "data")
    assert_same_bytes(storage.data_transpose, data.t().contiguous(), "data_transpose")
    assert_same_bytes(storage.scale_inv, scale_inv, "scale_inv")
    assert amax.item() >= x_new.abs().max().item()


# --------------------------------------------------------------------------------------------
# delayed scaling state
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_delayed_scaling_amax_and_scale(dtype):
    scale, amax = torch.tensor([37.5]), torch.zeros(1)
    q = mf.Float8Quantizer(scale, amax, dtype)
    gen = torch.Generator().manual_seed(71)
    x = torch.randn(24, 40, generator=gen)
    out = q(x).quantized_storage
    assert amax.item() == x.abs().max().item()
    data, _ = plain_per_tensor(x, dtype, torch.tensor(37.5))
    assert_same_bytes(out.data, data, "data")
    assert out.scale_inv.item() == (torch.tensor(1.0) / torch.tensor(37.5)).item()
    assert out.fp8_dtype == dtype
    # smaller input: amax keeps the max; bigger input: amax grows
    q(x * 0.25)
    assert amax.item() == x.abs().max().item()
    q(x * 3)
    assert amax.item() == (x * 3).abs().max().item()
    # the state scale is read at each call (shared tensor, updated in place by the recipe)
    scale.fill_(2.0)
    out = q(x).quantized_storage
    assert_same_bytes(out.data, plain_per_tensor(x, dtype, torch.tensor(2.0))[0], "data")
    assert out.scale_inv.item() == 0.5


def test_delayed_scaling_saturates_past_the_format_max():
    q = mf.Float8Quantizer(torch.tensor([100.0]), torch.zeros(1))
    x = torch.tensor([[10.0, -10.0, 4.47, 4.5, 4.64, 1.0, 0.0, -0.0] * 2])
    out = q(x).quantized_storage
    values = out.data.float()
    # 1000 -> 448; 447 -> 448 (RNE on the 32-spaced grid [416, 448]); 450/464 -> 448 (saturate)
    assert values[0, :5].tolist() == [448.0, -448.0, 448.0, 448.0, 448.0]
    assert values[0, 5].item() == 96.0  # 100 is a tie between 96 and 104 (spacing 8): even
    assert as_bytes(out.data)[0, 7].item() == 0x80  # -0 keeps its sign
    assert not torch.isnan(out.data.float()).any()


def test_delayed_scaling_validates_its_state():
    with pytest.raises(ValueError, match="1-element"):
        mf.Float8Quantizer(torch.ones(2), torch.zeros(1))
    with pytest.raises(ValueError, match="FP8 dtype"):
        mf.Float8Quantizer(torch.ones(1), torch.zeros(1), torch.bfloat16)


# --------------------------------------------------------------------------------------------
# stochastic rounding (NUMERICS.md §7): statistics, not bytes
# --------------------------------------------------------------------------------------------


def _grid_neighbours(magnitude: torch.Tensor):
    """(largest E2M1 magnitude <= m, smallest >= m), saturating at 6."""
    grid = E2M1_GRID
    m = magnitude.clamp(max=6.0)
    lower = grid[(grid[None, :] <= m.reshape(-1, 1)).sum(1) - 1].reshape(m.shape)
    upper = grid[torch.clamp(8 - (grid[None, :] >= m.reshape(-1, 1)).sum(1), max=7)]
    return lower, upper.reshape(m.shape)


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_stochastic_rounding_picks_a_neighbour(direction, two_d):
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(81))
    x = x.clamp(-3.9, 3.9)
    x[0, 0] = 4.0  # A = 4: S_enc = 672 exactly
    usage = {"rowwise": direction == "rowwise", "columnwise": direction == "columnwise"}
    rne = mf.NVFP4Quantizer(with_2d_quantization=two_d, **usage)(x).quantized_storage
    torch.manual_seed(82)
    sr = mf.NVFP4Quantizer(stochastic_rounding=True, with_2d_quantization=two_d, **usage)(x)
    sr = sr.quantized_storage
    prefix = "rowwise" if direction == "rowwise" else "columnwise"
    # SR changes the elements only: block scales and the global amax are the RNE ones
    assert_same_bytes(getattr(sr, f"{prefix}_scale"), getattr(rne, f"{prefix}_scale"), "scale")
    amax_name = "amax_rowwise" if direction == "rowwise" else "amax_columnwise"
    assert_same_bytes(getattr(sr, amax_name), getattr(rne, amax_name), "amax")
    xd = x if direction == "rowwise" else x.t()
    scale = getattr(sr, f"{prefix}_scale").float().repeat_interleave(16, 1)
    units = xd / (scale * (4.0 / 2688.0))  # x in units of s_b * S_dec
    lower, upper = _grid_neighbours(units.abs() * (1 - 1e-5))[0], _grid_neighbours(
        units.abs() * (1 + 1e-5)
    )[1]
    got = plain_e2m1_decode(getattr(sr, f"{prefix}_data"))
    assert ((got.abs() >= lower) & (got.abs() <= upper)).all()
    assert ((got == 0) | (torch.sign(got) == torch.sign(xd))).all()
    nearest = plain_e2m1_decode(getattr(rne, f"{prefix}_data"))
    differs = (got != nearest).float().mean().item()
    assert 0.1 < differs < 0.6  # it does round away from the nearest value, and not always


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_stochastic_rounding_is_unbiased(direction):
    """256 copies of one 32x64 tensor stacked along M: same scales for every copy (same global
    amax, blocks never straddle copies), independent draws. The mean over copies converges to
    x (error ~ RNE error / 16), and the overall bias is within 4 sigma of zero."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(83))
    copies = 256
    stacked = x.repeat(copies, 1)
    usage = {"rowwise": direction == "rowwise", "columnwise": direction == "columnwise"}
    torch.manual_seed(84)
    values = mf.NVFP4Quantizer(stochastic_rounding=True, **usage)(stacked).dequantize()
    values = values.reshape(copies, 32, 64)
    rne = mf.NVFP4Quantizer(**usage)(x).dequantize()
    rne_error = ((rne - x).norm() / x.norm()).item()
    mean_error = ((values.mean(0) - x).norm() / x.norm()).item()
    assert mean_error < rne_error / 4, (mean_error, rne_error)
    diff = values - x
    sigma = diff.std().item() / (diff.numel() ** 0.5)
    assert abs(diff.mean().item()) < 4 * sigma + 1e-7


def test_stochastic_rounding_is_reproducible_under_a_seed():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(85))
    q = mf.NVFP4Quantizer(stochastic_rounding=True, with_rht=True)

    def run(seed):
        torch.manual_seed(seed)
        s = q(x).quantized_storage
        return torch.cat([as_bytes(getattr(s, n)).reshape(-1) for n in s.tensor_fields()])

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))
