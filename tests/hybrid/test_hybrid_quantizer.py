"""HybridQuantizer: its two children (distinct, pinned, internal), usages, amax reduction groups,
copies, errors and pickling; and the bytes of each direction's copy, which must equal the plain
quantization of that direction by the child's own class (for every pair of families)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import minifloat as mf
from quantizers.cases import assert_same_bytes

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DELAYED_SCALE = torch.tensor([32.0])  # gaussian inputs times 32 stay inside E4M3's 448
SHAPE = (64, 128)  # multiples of 32 (MXFP8), 16 (NVFP4); one 128-block in K (block FP8)


def _delayed(dtype):
    def make(**usage):
        return mf.Float8Quantizer(DELAYED_SCALE, torch.zeros(1), dtype, **usage)

    return make


# family name -> make(rowwise=, columnwise=, internal=) -> a fresh quantizer of that family
MAKERS = {
    "current_e4m3": lambda **u: mf.Float8CurrentScalingQuantizer(E4M3, **u),
    "current_e5m2": lambda **u: mf.Float8CurrentScalingQuantizer(E5M2, **u),
    "delayed_e4m3": _delayed(E4M3),
    "block_1d": lambda **u: mf.Float8BlockQuantizer(1, **u),
    "block_2d": lambda **u: mf.Float8BlockQuantizer(2, **u),
    "mxfp8": lambda **u: mf.MXFP8Quantizer(**u),
    "nvfp4_1d": lambda **u: mf.NVFP4Quantizer(**u),
    "nvfp4_2d": lambda **u: mf.NVFP4Quantizer(with_2d_quantization=True, **u),
    "nvfp4_rht": lambda **u: mf.NVFP4Quantizer(with_rht=True, **u),
    "identity": lambda **u: mf.IdentityQuantizer(**u),
}
NAMES = list(MAKERS)


def make_input(shape=SHAPE, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def hybrid(row: str, col: str, **kwargs) -> mf.HybridQuantizer:
    return mf.HybridQuantizer(MAKERS[row](), MAKERS[col](), **kwargs)


def plain(name: str, x: torch.Tensor, columnwise: bool) -> mf.QuantizedStorage:
    """The plain one-direction quantization of x by a fresh quantizer of family `name`."""
    q = MAKERS[name](rowwise=not columnwise, columnwise=columnwise, internal=True)
    return q(x)


def assert_same_storage(actual, expected, what: str) -> None:
    """Same class, shape, dtype, metadata, the same buffers present, byte for byte."""
    assert actual is not None, f"{what}: missing"
    assert type(actual) is type(expected), f"{what}: {type(actual).__name__}"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    for name in expected.metadata_fields:
        assert getattr(actual, name) == getattr(expected, name), f"{what}.{name}"
    for name in expected.tensor_fields():
        a, e = getattr(actual, name), getattr(expected, name)
        assert (a is None) == (e is None), f"{what}.{name}: present {a is not None}"
        if e is not None:
            assert_same_bytes(a, e, f"{what}.{name}")


def usages(q: mf.Quantizer) -> tuple[bool, bool]:
    return q.rowwise_usage, q.columnwise_usage


# --------------------------------------------------------------------------------------------
# children: distinct, pinned, internal; set_usage forwards
# --------------------------------------------------------------------------------------------


def test_children_are_distinct_internal_and_pinned_to_one_direction():
    hq = hybrid("mxfp8", "nvfp4_1d")
    assert not hq.internal and usages(hq) == (True, True)
    assert hq.rowwise_quantizer is not hq.columnwise_quantizer
    assert usages(hq.rowwise_quantizer) == (True, False)
    assert usages(hq.columnwise_quantizer) == (False, True)
    assert hq.rowwise_quantizer.internal and hq.columnwise_quantizer.internal

    shared = mf.Float8Quantizer(torch.tensor([4.0]), torch.zeros(1))
    twice = mf.HybridQuantizer(shared, shared)
    row, col = twice.rowwise_quantizer, twice.columnwise_quantizer
    assert row is not col and type(row) is type(col) is mf.Float8Quantizer
    assert usages(row) == (True, False) and usages(col) == (False, True)
    assert row.internal and col.internal
    # a copy as Quantizer.copy makes it: the delayed-scaling state stays shared
    assert col.scale is shared.scale and col.amax is shared.amax
    out = twice(make_input())
    assert out.rowwise_storage.has_rowwise() and not out.rowwise_storage.has_columnwise()
    assert out.columnwise_storage.has_columnwise() and not out.columnwise_storage.has_rowwise()

    only_col = hybrid("mxfp8", "nvfp4_1d", rowwise=False)
    assert usages(only_col) == (False, True)
    assert usages(only_col.rowwise_quantizer) == (False, False)
    assert usages(only_col.columnwise_quantizer) == (False, True)


def test_set_usage_forwards_to_the_children():
    hq = hybrid("current_e4m3", "mxfp8")
    hq.set_usage(rowwise=False)
    assert usages(hq) == (False, True)
    assert usages(hq.rowwise_quantizer) == (False, False)
    assert usages(hq.columnwise_quantizer) == (False, True)
    hq.set_usage(rowwise=True, columnwise=False)
    assert usages(hq.rowwise_quantizer) == (True, False)
    assert usages(hq.columnwise_quantizer) == (False, False)
    hq.set_usage()  # None leaves both as they are
    assert usages(hq) == (True, False) and usages(hq.columnwise_quantizer) == (False, False)
    hq.set_usage(columnwise=True)
    assert usages(hq.rowwise_quantizer) == (True, False)
    assert usages(hq.columnwise_quantizer) == (False, True)


def test_a_quantizer_shared_by_two_hybrids_keeps_each_direction():
    shared = mf.MXFP8Quantizer()
    first = mf.HybridQuantizer(shared, mf.Float8CurrentScalingQuantizer())
    mf.HybridQuantizer(mf.Float8CurrentScalingQuantizer(), shared)
    x = make_input()
    assert_same_storage(first(x).rowwise_storage, plain("mxfp8", x, False), "rowwise")


# --------------------------------------------------------------------------------------------
# only the requested usages are quantized
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", [(True, False), (False, True), (True, True)],
                         ids=["rowwise", "columnwise", "both"])
@pytest.mark.parametrize("pair", [("mxfp8", "nvfp4_rht"), ("mxfp8", "mxfp8")], ids="-".join)
def test_only_requested_usages_are_quantized(pair, usage, monkeypatch):
    calls = []
    hq = hybrid(*pair)
    for cls in {type(hq.rowwise_quantizer), type(hq.columnwise_quantizer)}:
        original = cls._quantize_impl

        def counted(self, x, owner, _original=original):
            calls.append((type(self).__name__, self.rowwise_usage, self.columnwise_usage))
            return _original(self, x, owner)

        monkeypatch.setattr(cls, "_quantize_impl", counted)
    hq.set_usage(*usage)
    out = hq(make_input())
    expected = []
    if usage[0]:
        expected.append((type(hq.rowwise_quantizer).__name__, True, False))
    if usage[1]:
        expected.append((type(hq.columnwise_quantizer).__name__, False, True))
    assert calls == expected
    storage = out.quantized_storage
    assert (storage.has_rowwise(), storage.has_columnwise()) == usage
    if usage[0]:
        assert not out.rowwise_storage.has_columnwise()
    if usage[1]:
        assert not out.columnwise_storage.has_rowwise()


def test_delayed_children_record_amax_only_for_the_copies_quantized():
    row_amax, col_amax = torch.zeros(1), torch.zeros(1)
    hq = mf.HybridQuantizer(mf.Float8Quantizer(torch.tensor([4.0]), row_amax),
                            mf.Float8Quantizer(torch.tensor([2.0]), col_amax, E5M2))
    x = make_input()
    hq.set_usage(rowwise=True, columnwise=False)
    hq(x)
    assert row_amax.item() == x.abs().max().item() and col_amax.item() == 0.0
    hq.set_usage(rowwise=False, columnwise=True)
    hq(2 * x)
    assert row_amax.item() == x.abs().max().item()
    assert col_amax.item() == 2 * x.abs().max().item()


# --------------------------------------------------------------------------------------------
# amax reduction groups
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", [(True, False), (False, True), (True, True)],
                         ids=["rowwise", "columnwise", "both"])
def test_reduction_group_reaches_each_quantizing_child(one_rank_group, usage, monkeypatch):
    """Current FP8 and NVFP4 each reduce one amax per call; the spy sees the group on exactly
    the children that quantize. With one rank the reduction is the identity, so the bytes equal
    the group-less quantization; the group is stripped from everything the output records."""
    calls = []
    original = mf.Quantizer.reduce_amax

    def spy(self, amax):
        calls.append((type(self).__name__, self.amax_reduction_group))
        return original(self, amax)

    monkeypatch.setattr(mf.Quantizer, "reduce_amax", spy)
    hq = hybrid("current_e4m3", "nvfp4_rht")
    hq.set_usage(*usage)
    hq.amax_reduction_group = one_rank_group
    x = make_input(seed=3)
    out = hq(x)
    expected = []
    if usage[0]:
        expected.append(("Float8CurrentScalingQuantizer", one_rank_group))
    if usage[1]:
        expected.append(("NVFP4Quantizer", one_rank_group))
    assert calls == expected

    recorded = out.quantizer
    assert isinstance(recorded, mf.HybridQuantizer) and recorded.amax_reduction_group is None
    assert recorded.rowwise_quantizer.amax_reduction_group is None
    assert recorded.columnwise_quantizer.amax_reduction_group is None
    for sub in (out.rowwise_storage, out.columnwise_storage):
        assert sub is None or sub.quantizer.amax_reduction_group is None
    # the hybrid keeps its group; its children never hold it (it was for that call only)
    assert hq.amax_reduction_group is one_rank_group
    assert hq.rowwise_quantizer.amax_reduction_group is None
    assert hq.columnwise_quantizer.amax_reduction_group is None
    pickle.dumps(out)  # a process group would not pickle

    if usage[0]:
        assert_same_storage(out.rowwise_storage, plain("current_e4m3", x, False), "rowwise")
    if usage[1]:
        assert_same_storage(out.columnwise_storage, plain("nvfp4_rht", x, True), "columnwise")

    calls.clear()
    hq.amax_reduction_group = None
    hq(x)
    assert calls and all(group is None for _, group in calls)


# --------------------------------------------------------------------------------------------
# copy, requantization safety, errors, pickling
# --------------------------------------------------------------------------------------------


class _DummyGroup:
    """Stands in for a process group: pickling it must never be attempted."""

    def __reduce__(self):
        raise AssertionError("a reduction group was pickled")


def test_copy_has_independent_children_and_keeps_the_group():
    scale, amax = torch.tensor([4.0]), torch.zeros(1)
    hq = mf.HybridQuantizer(mf.Float8Quantizer(scale, amax), mf.Float8CurrentScalingQuantizer())
    group = _DummyGroup()
    hq.amax_reduction_group = group
    clone = hq.copy()
    assert type(clone) is mf.HybridQuantizer and clone is not hq
    assert clone.rowwise_quantizer is not hq.rowwise_quantizer
    assert clone.columnwise_quantizer is not hq.columnwise_quantizer
    # Quantizer.copy semantics: the copy carries the group and shares delayed-scaling state
    single = mf.MXFP8Quantizer()
    single.amax_reduction_group = group
    assert single.copy().amax_reduction_group is group
    assert clone.amax_reduction_group is group
    assert clone.rowwise_quantizer.scale is scale and clone.rowwise_quantizer.amax is amax
    hq.amax_reduction_group = None
    assert hq.copy().amax_reduction_group is None and clone.amax_reduction_group is group

    clone.set_usage(rowwise=False)
    clone.columnwise_quantizer.fp8_dtype = E5M2
    assert usages(hq) == (True, True)
    assert usages(hq.rowwise_quantizer) == (True, False)
    assert hq.columnwise_quantizer.fp8_dtype == E4M3
    x = make_input()
    clone.amax_reduction_group = None
    out = clone(x)
    assert out.rowwise_storage is None and out.columnwise_storage.fp8_dtype == E5M2
    assert_same_storage(hq(x).columnwise_storage, plain("current_e4m3", x, True), "original")


def _sr():
    return mf.NVFP4Quantizer(stochastic_rounding=True)


@pytest.mark.parametrize("row,col,safe", [
    (mf.MXFP8Quantizer, mf.NVFP4Quantizer, True),
    (mf.IdentityQuantizer, mf.Float8CurrentScalingQuantizer, True),
    (_sr, mf.MXFP8Quantizer, False),
    (mf.MXFP8Quantizer, _sr, False),
    (_sr, _sr, False),
], ids=["mx-nv", "id-fp8", "sr-mx", "mx-sr", "sr-sr"])
def test_requantization_is_safe_only_when_both_children_are(row, col, safe):
    hq = mf.HybridQuantizer(row(), col())
    assert hq.is_requantization_safe() is safe


@pytest.mark.parametrize("bad", ["mxfp8", None, torch.nn.Linear(2, 2), torch.zeros(1)],
                         ids=["str", "none", "module", "tensor"])
def test_a_child_that_is_not_a_quantizer_is_a_type_error(bad):
    with pytest.raises(TypeError, match="rowwise_quantizer must be a minifloat Quantizer"):
        mf.HybridQuantizer(bad, mf.MXFP8Quantizer())
    with pytest.raises(TypeError, match="columnwise_quantizer must be a minifloat Quantizer"):
        mf.HybridQuantizer(mf.MXFP8Quantizer(), bad)


def test_a_hybrid_child_is_a_type_error():
    inner = hybrid("mxfp8", "nvfp4_1d")
    with pytest.raises(TypeError, match="rowwise_quantizer is itself hybrid"):
        mf.HybridQuantizer(inner, mf.MXFP8Quantizer())
    with pytest.raises(TypeError, match="columnwise_quantizer is itself hybrid"):
        mf.HybridQuantizer(mf.MXFP8Quantizer(), inner)


@pytest.mark.parametrize("row,col,shape,fmt,block", [
    ("mxfp8", "current_e4m3", (48, 128), "MXFP8", 32),
    ("current_e4m3", "mxfp8", (64, 80), "MXFP8", 32),
    ("identity", "nvfp4_2d", (64, 40), "NVFP4", 16),
    ("nvfp4_rht", "block_1d", (24, 128), "NVFP4", 16),
], ids=["mx-row-M", "mx-col-K", "nv-col-K", "nv-row-M"])
def test_a_shape_that_does_not_fit_a_child_is_a_value_error(row, col, shape, fmt, block):
    hq = hybrid(row, col)
    x = make_input(shape)
    assert not hq.is_quantizable(x)
    with pytest.raises(ValueError, match=rf"{fmt} needs .* multiples of\s+{block}"):
        hq(x)
    # a child that does not quantize in this call does not constrain the shape
    child_is_row = row in ("mxfp8", "nvfp4_rht")
    hq.set_usage(rowwise=not child_is_row, columnwise=child_is_row)
    assert hq.is_quantizable(x)
    out = hq(x)
    assert out.shape == shape


def test_other_input_errors_are_clear():
    hq = hybrid("mxfp8", "nvfp4_1d")
    with pytest.raises(ValueError, match="0-dim"):
        hq(torch.tensor(1.0))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        hq(torch.ones(64, 128, dtype=torch.int32))
    hq.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="neither rowwise nor columnwise"):
        hq(make_input())


def _torch_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


ROUND_TRIPS = {"pickle": lambda o: pickle.loads(pickle.dumps(o)),
               "torch_weights_only": _torch_round_trip}


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_pickling_round_trips_and_never_pickles_a_group(how):
    hq = mf.HybridQuantizer(mf.Float8Quantizer(torch.tensor([8.0]), torch.zeros(1), E5M2),
                            mf.NVFP4Quantizer(with_rht=True), columnwise=True, internal=True)
    for q in (hq, hq.rowwise_quantizer, hq.columnwise_quantizer):
        q.amax_reduction_group = _DummyGroup()
    loaded = ROUND_TRIPS[how](hq)
    assert type(loaded) is mf.HybridQuantizer and loaded.internal and usages(loaded) == (True, True)
    row, col = loaded.rowwise_quantizer, loaded.columnwise_quantizer
    assert type(row) is mf.Float8Quantizer and type(col) is mf.NVFP4Quantizer
    assert row is not col
    assert usages(row) == (True, False) and usages(col) == (False, True)
    assert row.fp8_dtype == E5M2 and torch.equal(row.scale, torch.tensor([8.0]))
    assert col.with_rht and not col.with_2d_quantization and not col.stochastic_rounding
    for q in (loaded, row, col):
        assert q.amax_reduction_group is None
    assert isinstance(hq.amax_reduction_group, _DummyGroup)  # the live quantizer is untouched

    for q in (hq, hq.rowwise_quantizer, hq.columnwise_quantizer):
        q.amax_reduction_group = None
    x = make_input(seed=5)
    expected, actual = hq(x), loaded(x)
    assert_same_storage(actual.rowwise_storage, expected.rowwise_storage, "rowwise")
    assert_same_storage(actual.columnwise_storage, expected.columnwise_storage, "columnwise")


# --------------------------------------------------------------------------------------------
# bytes: each copy equals the plain quantization by its child's class
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("col", NAMES)
@pytest.mark.parametrize("row", NAMES)
def test_each_copy_equals_the_plain_quantization_of_its_child(row, col):
    x = make_input(seed=11)
    out = hybrid(row, col)(x)
    assert isinstance(out, mf.HybridQuantizedTensor) and out.shape == x.shape
    assert_same_storage(out.rowwise_storage, plain(row, x, columnwise=False), f"{row} rowwise")
    assert_same_storage(out.columnwise_storage, plain(col, x, columnwise=True),
                        f"{col} columnwise")


ROTATED = [(NAMES[i], NAMES[(i + 4) % len(NAMES)]) for i in range(len(NAMES))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("usage", [(True, False), (False, True)], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("pair", ROTATED, ids="-".join)
def test_one_direction_of_a_3d_input(pair, usage, dtype):
    x = make_input((2, 32, 128), seed=12, dtype=dtype)
    hq = hybrid(*pair)
    hq.set_usage(*usage)
    out = hq(x)
    assert out.shape == x.shape and out.dtype == dtype
    if usage[0]:
        assert out.columnwise_storage is None
        assert_same_storage(out.rowwise_storage, plain(pair[0], x, False), "rowwise")
    else:
        assert out.rowwise_storage is None
        assert_same_storage(out.columnwise_storage, plain(pair[1], x, True), "columnwise")


def _adversarial(kind: str) -> torch.Tensor:
    x = make_input(seed=15)
    if kind == "zeros":
        return torch.zeros(SHAPE)
    if kind == "one_huge":
        x[3, 17] = 3.0e38
    elif kind == "subnormal":
        x = x * 1e-40
    elif kind == "ties":  # halfway between E4M3 neighbours 1.0 and 1.125 at scale 1
        x[::2] = 1.0625
    return x


@pytest.mark.parametrize("kind", ["zeros", "one_huge", "subnormal", "ties"])
@pytest.mark.parametrize("pair", ROTATED, ids="-".join)
def test_adversarial_inputs_match_the_plain_children(pair, kind):
    x = _adversarial(kind)
    out = hybrid(*pair)(x)
    assert_same_storage(out.rowwise_storage, plain(pair[0], x, False), f"{kind} rowwise")
    assert_same_storage(out.columnwise_storage, plain(pair[1], x, True), f"{kind} columnwise")


def test_stochastic_children_draw_rowwise_then_columnwise():
    x = make_input(seed=13)
    hq = mf.HybridQuantizer(mf.NVFP4Quantizer(stochastic_rounding=True),
                            mf.NVFP4Quantizer(stochastic_rounding=True, with_rht=True))
    torch.manual_seed(7)
    out = hq(x)
    torch.manual_seed(7)
    row = mf.NVFP4Quantizer(stochastic_rounding=True, columnwise=False, internal=True)(x)
    col = mf.NVFP4Quantizer(stochastic_rounding=True, with_rht=True, rowwise=False,
                            internal=True)(x)
    assert_same_storage(out.rowwise_storage, row, "rowwise")
    assert_same_storage(out.columnwise_storage, col, "columnwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("other", ["identity", "mxfp8"])
def test_identity_children_keep_values_exactly_in_a_copy(other, dtype):
    x = make_input((2, 32, 128), seed=14, dtype=dtype)
    flat = x.reshape(-1, 128)
    keep = flat.clone()
    out = mf.HybridQuantizer(mf.IdentityQuantizer(), MAKERS[other]())(x)
    held = [out.rowwise_storage.rowwise_data]
    if other == "identity":
        held.append(out.columnwise_storage.columnwise_data)
        assert held[0].data_ptr() != held[1].data_ptr()  # each child made its own copy
    for data in held:
        assert data.dtype == dtype
        assert torch.equal(data.view(torch.uint8), flat.view(torch.uint8))  # bit-equal
        assert data.data_ptr() != x.data_ptr()
    x.mul_(3.0)  # the caller's tensor changes; the quantized copies must not
    for data in held:
        assert torch.equal(data.view(torch.uint8), keep.view(torch.uint8))
    assert torch.equal(out.dequantize().view(torch.uint8), keep.reshape(x.shape).view(torch.uint8))
