"""HybridStorage / HybridQuantizedTensor (accessors, dequantize, usages, copies, saving, in-place
updates, reshape) and general_gemm on hybrid operands of different families, against the
independent references of tests/training/_reference.py."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import minifloat as mf
from minifloat import general_gemm
from quantizers.cases import REQUANTIZE_MESSAGE
from training._reference import (
    E4M3,
    E5M2,
    assert_bitwise_equal,
    gemm,
    op_block_2d,
    op_current,
    op_delayed,
    op_mxfp8,
    op_nvfp4,
)

from .test_hybrid_quantizer import MAKERS, assert_same_storage, hybrid, make_input, plain


def _buffers(sub):
    return [getattr(sub, n) for n in sub.tensor_fields() if getattr(sub, n) is not None]


def _subs(t):
    return [s for s in (t.rowwise_storage, t.columnwise_storage) if s is not None]


def assert_requantized(t, names, y, what=""):
    """Each copy t holds equals the plain quantization of y by that direction's family."""
    row, col = names
    if t.rowwise_storage is not None:
        assert_same_storage(t.rowwise_storage, plain(row, y, False), f"{what} rowwise")
    if t.columnwise_storage is not None:
        assert_same_storage(t.columnwise_storage, plain(col, y, True), f"{what} columnwise")


# --------------------------------------------------------------------------------------------
# structure and values
# --------------------------------------------------------------------------------------------


def test_quantized_tensor_of_a_hybrid_storage_is_a_hybrid_tensor():
    x = make_input((2, 32, 128))
    storage = hybrid("current_e4m3", "mxfp8", internal=True)(x)
    assert type(storage) is mf.HybridStorage
    t = mf.QuantizedTensor(storage, requires_grad=True)
    assert type(t) is mf.HybridQuantizedTensor and t.requires_grad
    assert t.quantized_storage is storage
    assert t.rowwise_storage is storage.rowwise_storage
    assert t.columnwise_storage is storage.columnwise_storage
    assert isinstance(t.rowwise_storage, mf.Float8Storage)
    assert isinstance(t.columnwise_storage, mf.MXFP8Storage)
    assert t.shape == x.shape and t.dtype == x.dtype and t.device == x.device
    assert t.size() == x.shape and t.size(1) == 32
    assert storage.size() == x.shape and storage.size(-1) == 128
    assert storage.device == torch.device("cpu")
    storage.update_usage(rowwise=False)
    assert storage.device == torch.device("cpu")  # from the copy that is left
    assert isinstance(hybrid("mxfp8", "nvfp4_1d")(x), mf.HybridQuantizedTensor)


def test_sub_storages_must_keep_the_logical_shape():
    sub = plain("mxfp8", make_input((32, 128)), False)
    with pytest.raises(ValueError, match="logical shape"):
        mf.HybridStorage(shape=(64, 128), dtype=torch.float32, rowwise_storage=sub)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["nominal", "bf16"])
def test_dequantize_prefers_rowwise_and_falls_back_to_columnwise(dtype):
    x = make_input((2, 32, 128), seed=1)
    t = hybrid("nvfp4_1d", "identity")(x)
    expected_dtype = dtype or torch.float32
    row_values = t.rowwise_storage.dequantize(dtype)
    assert not torch.equal(row_values.float(), x)  # the two copies differ: NVFP4 is coarse
    got = t.dequantize(dtype)
    assert got.dtype == expected_dtype and got.shape == x.shape
    assert_bitwise_equal(got, row_values, "rowwise copy preferred")
    t.update_usage(rowwise=False)
    assert t.rowwise_storage is None
    assert_bitwise_equal(t.dequantize(dtype), x.to(expected_dtype), "columnwise fallback")


# --------------------------------------------------------------------------------------------
# update_usage: drop, derive, refuse
# --------------------------------------------------------------------------------------------


def test_update_usage_drops_a_copy_and_keeps_the_other():
    for drop, keep in (("rowwise", "columnwise"), ("columnwise", "rowwise")):
        t = hybrid("current_e4m3", "nvfp4_rht")(make_input())
        kept = getattr(t, f"{keep}_storage")
        reference = getattr(t.clone(), f"{keep}_storage")
        t.update_usage(**{drop: False})
        assert getattr(t, f"{drop}_storage") is None
        assert not getattr(t.quantized_storage, f"has_{drop}")()
        assert getattr(t, f"{keep}_storage") is kept
        assert_same_storage(kept, reference, f"kept {keep}")
        t.update_usage(**{keep: True})  # asking for a copy it has changes nothing
        assert getattr(t, f"{keep}_storage") is kept


def _shared_delayed_pair():
    q = MAKERS["delayed_e4m3"]()
    return mf.HybridQuantizer(q, q)  # the copy shares the scale: same format both ways


DERIVABLE = {
    "current_e4m3": lambda: hybrid("current_e4m3", "current_e4m3"),
    "delayed_shared_state": _shared_delayed_pair,
    "block_2d": lambda: hybrid("block_2d", "block_2d"),
    "nvfp4_2d": lambda: hybrid("nvfp4_2d", "nvfp4_2d"),
    "identity": lambda: hybrid("identity", "identity"),
}


@pytest.mark.parametrize("drop", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", list(DERIVABLE))
def test_a_missing_copy_is_derived_when_both_directions_share_a_format(name, drop):
    t = DERIVABLE[name]()(make_input((2, 32, 128), seed=2))
    before = t.clone()
    keep = {"rowwise": drop == "columnwise", "columnwise": drop == "rowwise"}
    t.update_usage(**keep)
    assert getattr(t, f"{drop}_storage") is None
    t.update_usage(**{drop: True})
    assert_same_storage(t.rowwise_storage, before.rowwise_storage, f"{name} rowwise")
    assert_same_storage(t.columnwise_storage, before.columnwise_storage, f"{name} columnwise")
    # switch copies in one call: derive the missing one from the one that is then dropped
    other = "columnwise" if drop == "rowwise" else "rowwise"
    t.update_usage(**{drop: False})
    t.update_usage(**{drop: True, other: False})
    assert getattr(t, f"{other}_storage") is None
    assert_same_storage(getattr(t, f"{drop}_storage"), getattr(before, f"{drop}_storage"), drop)


def _separate_delayed_pair():
    return mf.HybridQuantizer(MAKERS["delayed_e4m3"](), MAKERS["delayed_e4m3"]())


NOT_DERIVABLE = {
    # formats differ: the hybrid refuses
    "fp8-mxfp8": (lambda: hybrid("current_e4m3", "mxfp8"), "cannot be derived"),
    "e4m3-e5m2": (lambda: hybrid("current_e4m3", "current_e5m2"), "cannot be derived"),
    "nvfp4-2d-vs-1d": (lambda: hybrid("nvfp4_2d", "nvfp4_1d"), "cannot be derived"),
    "delayed-separate-state": (_separate_delayed_pair, "cannot be derived"),
    # same format, but it cannot derive one direction from the other (NUMERICS.md §9)
    "block_1d": (lambda: hybrid("block_1d", "block_1d"), "FP8 block scaling"),
    "mxfp8": (lambda: hybrid("mxfp8", "mxfp8"), "MXFP8"),
    "nvfp4_rht": (lambda: hybrid("nvfp4_rht", "nvfp4_rht"), "NVFP4"),
}


@pytest.mark.parametrize("drop", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", list(NOT_DERIVABLE))
def test_a_copy_that_cannot_be_derived_is_a_clear_value_error(name, drop):
    make, message = NOT_DERIVABLE[name]
    t = make()(make_input(seed=3))
    other = "columnwise" if drop == "rowwise" else "rowwise"
    t.update_usage(**{drop: False})
    kept = getattr(t, f"{other}_storage")
    with pytest.raises(ValueError, match=message) as info:
        t.update_usage(**{drop: True})
    assert REQUANTIZE_MESSAGE.search(str(info.value)), str(info.value)
    assert getattr(t, f"{drop}_storage") is None and getattr(t, f"{other}_storage") is kept


def test_dropping_both_copies_is_refused():
    t = hybrid("mxfp8", "nvfp4_1d")(make_input())
    with pytest.raises(ValueError, match="both the rowwise and the columnwise"):
        t.update_usage(rowwise=False, columnwise=False)
    assert t.rowwise_storage is not None and t.columnwise_storage is not None
    t.update_usage(rowwise=False)
    with pytest.raises(ValueError, match="both the rowwise and the columnwise"):
        t.update_usage(columnwise=False)
    assert t.columnwise_storage is not None


# --------------------------------------------------------------------------------------------
# detach, clone, pickling, saving for backward
# --------------------------------------------------------------------------------------------


def test_detach_shares_buffers_and_clone_does_not():
    t = hybrid("delayed_e4m3", "nvfp4_2d")(make_input(seed=4))
    d, c = t.detach(), t.clone()
    for other in (d, c):
        assert type(other) is mf.HybridQuantizedTensor and other.shape == t.shape
        assert other.quantized_storage is not t.quantized_storage
        assert_same_storage(other.rowwise_storage, t.rowwise_storage, "rowwise")
        assert_same_storage(other.columnwise_storage, t.columnwise_storage, "columnwise")
    for mine, shared, cloned in zip(_subs(t), _subs(d), _subs(c), strict=True):
        assert shared is not mine and cloned is not mine
        for a, b, e in zip(_buffers(mine), _buffers(shared), _buffers(cloned), strict=True):
            assert a.data_ptr() == b.data_ptr() and a.data_ptr() != e.data_ptr()
    c.columnwise_storage.columnwise_data.zero_()
    assert t.columnwise_storage.columnwise_data.any()


def _torch_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


ROUND_TRIPS = {"pickle": lambda o: pickle.loads(pickle.dumps(o)),
               "torch_weights_only": _torch_round_trip}


@pytest.mark.parametrize("drop", [None, "rowwise", "columnwise"])
@pytest.mark.parametrize("pair", [("current_e4m3", "mxfp8"), ("nvfp4_2d", "nvfp4_rht"),
                                  ("block_1d", "identity")], ids="-".join)
@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_round_trips_keep_every_byte(how, pair, drop):
    t = hybrid(*pair)(make_input((2, 32, 128), seed=5))
    if drop:
        t.update_usage(**{drop: False})
    loaded = ROUND_TRIPS[how](t)
    assert type(loaded) is mf.HybridQuantizedTensor
    assert loaded.shape == t.shape and loaded.dtype == t.dtype
    for direction in ("rowwise", "columnwise"):
        mine, theirs = getattr(t, f"{direction}_storage"), getattr(loaded, f"{direction}_storage")
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert_same_storage(theirs, mine, f"{how} {direction}")
    assert isinstance(loaded.quantizer, mf.HybridQuantizer)
    # the loaded tensor still requantizes in place with its recorded quantizer
    y = make_input((2, 32, 128), seed=6)
    loaded.data = y
    assert_requantized(loaded, pair, y, how)


@pytest.mark.parametrize("drop", [None, "rowwise"])
def test_prepare_for_saving_and_restore(drop):
    t = hybrid("nvfp4_rht", "current_e5m2")(make_input(seed=7))
    if drop:
        t.update_usage(rowwise=False)
    reference = t.clone()
    originals = [b for sub in _subs(t) for b in _buffers(sub)]
    tensors, obj = t.prepare_for_saving()
    assert obj is t.quantized_storage
    assert {id(b) for b in tensors if b is not None} == {id(b) for b in originals}
    for sub in _subs(t):  # the object keeps metadata only
        assert all(getattr(sub, n) is None for n in sub.tensor_fields())
    assert obj.shape == reference.shape and obj.dtype == reference.dtype
    extra = [torch.ones(3), None]
    assert t.restore_from_saved(list(tensors) + extra) == extra
    for mine, ref in zip(_subs(t), _subs(reference), strict=True):
        assert_same_storage(mine, ref, "restored")
    assert torch.equal(t.dequantize(), reference.dequantize())


# --------------------------------------------------------------------------------------------
# in-place updates and reshape
# --------------------------------------------------------------------------------------------

PAIR = ("current_e4m3", "mxfp8")


def test_data_assignment_requantizes_both_copies_in_place():
    t = hybrid(*PAIR)(make_input(seed=8))
    pointers = [b.data_ptr() for sub in _subs(t) for b in _buffers(sub)]
    y = make_input(seed=9) * 3
    t.data = y
    assert_requantized(t, PAIR, y, ".data =")
    assert [b.data_ptr() for sub in _subs(t) for b in _buffers(sub)] == pointers
    with pytest.raises(ValueError, match="keeps its shape"):
        t.data = make_input((32, 128))
    assert_requantized(t, PAIR, y, "after the refused assignment")


def test_data_assignment_on_one_copy_requantizes_that_copy_only():
    t = hybrid("nvfp4_2d", "block_1d")(make_input(seed=8))
    t.update_usage(rowwise=False)
    y = make_input(seed=10)
    t.data = y
    assert t.rowwise_storage is None
    assert_requantized(t, ("nvfp4_2d", "block_1d"), y, "columnwise only")


def test_copy_from_high_precision_requantizes():
    t = hybrid("delayed_e4m3", "nvfp4_rht")(make_input(seed=11))
    y = make_input(seed=12)
    t.copy_(y)
    assert_requantized(t, ("delayed_e4m3", "nvfp4_rht"), y, "copy_")


def test_copy_from_a_same_format_hybrid_copies_bytes():
    pair = ("nvfp4_1d", "mxfp8")
    y = make_input(seed=13)
    src = hybrid(*pair)(y)
    dst = hybrid(*pair)(make_input(seed=14))
    pointers = [b.data_ptr() for sub in _subs(dst) for b in _buffers(sub)]
    # requantizing from the (rowwise) dequantized values would give other columnwise bytes
    from_values = plain("mxfp8", src.dequantize(), True).columnwise_data.view(torch.uint8)
    assert not torch.equal(from_values, src.columnwise_storage.columnwise_data.view(torch.uint8))
    dst.copy_(src)
    assert_same_storage(dst.rowwise_storage, src.rowwise_storage, "rowwise")
    assert_same_storage(dst.columnwise_storage, src.columnwise_storage, "columnwise")
    assert [b.data_ptr() for sub in _subs(dst) for b in _buffers(sub)] == pointers


def test_copy_from_another_format_requantizes_its_values():
    src = hybrid("nvfp4_1d", "mxfp8")(make_input(seed=15))
    dst = hybrid(*PAIR)(make_input(seed=16))
    dst.copy_(src)
    assert_requantized(dst, PAIR, src.dequantize(), "copy_ across formats")


def test_an_in_place_op_requantizes_both_copies():
    t = hybrid(*PAIR)(make_input(seed=17))
    expected = t.dequantize() * 0.75
    pointer = t.columnwise_storage.columnwise_data.data_ptr()
    out = t.mul_(0.75)
    assert out is t and type(t) is mf.HybridQuantizedTensor
    assert_requantized(t, PAIR, expected, "mul_")
    assert t.columnwise_storage.columnwise_data.data_ptr() == pointer


def test_reshape_keeping_the_last_dim_keeps_the_hybrid():
    t = hybrid(*PAIR)(make_input(seed=18))
    r = t.reshape(2, 32, 128)
    assert type(r) is mf.HybridQuantizedTensor and r.shape == (2, 32, 128)
    assert_bitwise_equal(r.dequantize(), t.dequantize().reshape(2, 32, 128), "reshape")
    for mine, theirs in zip(_subs(r), _subs(t), strict=True):  # a view: buffers shared
        for a, b in zip(_buffers(mine), _buffers(theirs), strict=True):
            assert a.data_ptr() == b.data_ptr()
    v = t.view(-1, 4, 128)
    assert type(v) is mf.HybridQuantizedTensor and v.shape == (16, 4, 128)
    flat = t.reshape(32, 256)  # mixes rows and blocks: high precision instead
    assert not isinstance(flat, mf.QuantizedTensor)
    assert_bitwise_equal(flat, t.dequantize().reshape(32, 256), "reshape across K")


def test_a_reshaped_hybrid_stays_usable():
    t = hybrid(*PAIR)(make_input(seed=19))
    r = t.reshape(2, 32, 128)
    assert all(sub.shape == r.shape for sub in _subs(r))
    assert r.clone().shape == r.detach().shape == (2, 32, 128)
    assert r.reshape(64, 128).shape == (64, 128)
    y = make_input((2, 32, 128), seed=20)
    r.data = y
    assert_requantized(r, PAIR, y, "reshaped")


# --------------------------------------------------------------------------------------------
# general_gemm on hybrid operands across families
# --------------------------------------------------------------------------------------------
# The references decode each operand with numerics only and multiply in fp32 through the same
# [rows, reduction] torch.matmul with the per-tensor factors applied after accumulation, as the
# emulation does, so every comparison below is bit for bit (deterministic CPU matmul).

M, K, N = 64, 128, 96


@pytest.fixture(scope="module")
def operands():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(M, N, generator=g) * 1e-3
    bias = torch.randn(N, generator=g)
    return x, w, dy, bias


def _transposed(op):
    """Per-tensor FP8: the columnwise copy is the byte transpose of the rowwise one."""
    def column(t):
        values, alpha = op(t.t())
        return values.t(), alpha
    return column


def test_fprop_per_tensor_fp8_times_mxfp8(operands):
    x, w, _, bias = operands
    xq = hybrid("current_e4m3", "nvfp4_rht")(x)
    wq = hybrid("mxfp8", "nvfp4_2d")(w)
    assert_bitwise_equal(general_gemm(xq, wq), gemm(op_current(x, E4M3), op_mxfp8(w)), "fprop")
    y = general_gemm(xq, wq, bias=bias, out_dtype=torch.bfloat16)
    expected = gemm(op_current(x, E4M3), op_mxfp8(w), bias=bias, out_dtype=torch.bfloat16)
    assert_bitwise_equal(y, expected, "fprop bias bf16")
    bare = general_gemm(hybrid("current_e4m3", "nvfp4_rht", internal=True)(x),
                        hybrid("mxfp8", "nvfp4_2d", internal=True)(w))
    assert_bitwise_equal(bare, gemm(op_current(x, E4M3), op_mxfp8(w)), "bare storages")


def test_dgrad_mxfp8_times_nvfp4_2d_columnwise(operands):
    _, w, dy, _ = operands
    dyq = hybrid("mxfp8", "nvfp4_rht")(dy)
    wq = hybrid("delayed_e4m3", "nvfp4_2d")(w)
    dx = general_gemm(dyq, wq, b_columnwise=True)
    assert dx.shape == (M, K)
    expected = gemm(op_mxfp8(dy), op_nvfp4(w.t(), two_dimensional=True))
    assert_bitwise_equal(dx, expected, "dgrad")
    w_delayed = hybrid("mxfp8", "delayed_e4m3")(w)
    expected = gemm(op_mxfp8(dy), _transposed(lambda t: op_delayed(t, 32.0, E4M3))(w.t()))
    assert_bitwise_equal(general_gemm(dyq, w_delayed, b_columnwise=True), expected, "dgrad fp8")


def test_wgrad_both_columnwise_nvfp4_with_rht(operands):
    x, _, dy, _ = operands
    dyq = hybrid("mxfp8", "nvfp4_rht")(dy)
    xq = hybrid("current_e4m3", "nvfp4_rht")(x)
    dw = general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True)
    assert dw.shape == (N, K)
    expected = gemm(op_nvfp4(dy.t(), rht=True), op_nvfp4(x.t(), rht=True))
    assert_bitwise_equal(dw, expected, "wgrad rht")


def test_wgrad_mxfp8_times_per_tensor_fp8_and_block_2d(operands):
    x, w, dy, _ = operands
    dyq = hybrid("nvfp4_1d", "mxfp8")(dy)
    xq = hybrid("block_1d", "current_e5m2")(x)
    dw = general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True)
    expected = gemm(op_mxfp8(dy.t()), _transposed(lambda t: op_current(t, E5M2))(x.t()))
    assert_bitwise_equal(dw, expected, "wgrad mixed")
    wq = hybrid("identity", "block_2d")(w)
    assert_bitwise_equal(general_gemm(dyq, wq, b_columnwise=True),
                         gemm(op_nvfp4(dy), op_block_2d(w.t())), "dgrad block 2d")


def test_identity_operand_with_an_fp8_one(operands):
    x, w, dy, bias = operands
    xq = hybrid("identity", "current_e4m3")(x)
    wq = hybrid("current_e4m3", "identity")(w)
    y = general_gemm(xq, wq, bias=bias)
    assert_bitwise_equal(y, gemm((x, None), op_current(w, E4M3), bias=bias), "fprop identity")
    dyq = hybrid("current_e5m2", "identity")(dy)
    dx = general_gemm(dyq, wq, b_columnwise=True)
    assert_bitwise_equal(dx, gemm(op_current(dy, E5M2), (w.t(), None)), "dgrad identity")
    dw = general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True)
    expected = gemm((dy.t(), None), _transposed(lambda t: op_current(t, E4M3))(x.t()))
    assert_bitwise_equal(dw, expected, "wgrad identity x fp8")


def test_hybrid_and_plain_operands_mix(operands):
    x, w, _, _ = operands
    xq = hybrid("mxfp8", "nvfp4_rht")(x)
    expected = gemm(op_mxfp8(x), op_nvfp4(w, two_dimensional=True))
    assert_bitwise_equal(general_gemm(xq, mf.NVFP4Quantizer(with_2d_quantization=True)(w)),
                         expected, "hybrid x plain NVFP4")
    assert_bitwise_equal(general_gemm(xq, w), gemm(op_mxfp8(x), (w, None)), "hybrid x tensor")


def test_wgrad_with_rht_on_one_operand_only_is_a_value_error(operands):
    x, _, dy, _ = operands
    dyq = hybrid("mxfp8", "nvfp4_rht")(dy)
    for other in (hybrid("current_e4m3", "nvfp4_1d")(x), hybrid("nvfp4_rht", "mxfp8")(x)):
        with pytest.raises(ValueError, match="Hadamard"):
            general_gemm(dyq, other, a_columnwise=True, b_columnwise=True)
        with pytest.raises(ValueError, match="Hadamard"):
            general_gemm(other, dyq, a_columnwise=True, b_columnwise=True)


def test_a_copy_the_hybrid_lacks_is_a_value_error(operands):
    x, w, dy, _ = operands
    xq = hybrid("current_e4m3", "nvfp4_rht")(x)
    xq.update_usage(columnwise=False)
    dyq = hybrid("mxfp8", "nvfp4_rht")(dy)
    with pytest.raises(ValueError, match="lacks the columnwise copy"):
        general_gemm(dyq, xq, a_columnwise=True, b_columnwise=True)
    wq = hybrid("mxfp8", "nvfp4_2d")
    wq.set_usage(rowwise=False)
    w_col = wq(w)
    with pytest.raises(ValueError, match="lacks the rowwise copy"):
        general_gemm(xq, w_col)
    with pytest.raises(ValueError, match="lacks the rowwise copy"):
        w_col.quantized_storage.direction_storage(columnwise=False)
    general_gemm(dyq, w_col, b_columnwise=True)  # the copy it has still serves dgrad
