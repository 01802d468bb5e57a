"""Pickling and torch.save / torch.load(weights_only=True) of quantized tensors, bare storages and
quantizers; amax reduction groups never travel."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import minifloat as mf

from .cases import (
    ALL,
    FAMILIES,
    USAGE_IDS,
    USAGES,
    assert_same_bytes,
    check_buffers,
    family_input,
)

# families whose quantize() all-reduces an amax when a group is set (a dummy group cannot run)
REDUCING = {"current_e4m3", "current_e5m2", "nvfp4", "nvfp4_rht", "nvfp4_sr", "nvfp4_2d"}
NON_REDUCING = [n for n in ALL if n not in REDUCING]


def torch_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def pickle_round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


ROUND_TRIPS = {"pickle": pickle_round_trip, "torch_weights_only": torch_round_trip}


def assert_same_storage(loaded, original, family):
    assert type(loaded) is type(original)
    assert loaded.shape == original.shape and isinstance(loaded.shape, torch.Size)
    assert loaded.dtype == original.dtype
    for n in original.tensor_fields():
        a, b = getattr(loaded, n), getattr(original, n)
        assert (a is None) == (b is None), n
        if b is not None:
            assert_same_bytes(a, b, f"{family.name}.{n}")
    for n in original.metadata_fields:
        assert getattr(loaded, n) == getattr(original, n), n
    assert_same_quantizer(loaded.quantizer, original.quantizer)


def assert_same_quantizer(loaded, original):
    assert type(loaded) is type(original) and loaded is not original
    assert loaded.__dict__.keys() == original.__dict__.keys()
    for key, value in original.__dict__.items():
        other = loaded.__dict__[key]
        if key == "amax_reduction_group":
            assert other is None
        elif isinstance(value, torch.Tensor):
            assert torch.equal(other, value), key
        else:
            assert other == value, key


# --------------------------------------------------------------------------------------------
# quantized tensors and storages
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("usage", USAGES, ids=USAGE_IDS)
@pytest.mark.parametrize("name", ALL)
def test_quantized_tensor_round_trip(name, usage, how):
    family = FAMILIES[name]
    x = family_input(family, family.leading_shape)
    qt = family.quantize(x, *usage)
    loaded = ROUND_TRIPS[how](qt)
    assert isinstance(loaded, mf.QuantizedTensor)
    assert loaded.shape == qt.shape and loaded.dtype == qt.dtype and not loaded.requires_grad
    assert_same_storage(loaded.quantized_storage, qt.quantized_storage, family)
    assert torch.equal(loaded.dequantize(), qt.dequantize())
    # a loaded tensor is fully functional: it still quantizes in place
    y = family_input(family, family.leading_shape, seed=9)
    if family.stochastic:
        torch.manual_seed(1234)
    loaded.quantizer.update_quantized(y, loaded)
    check_buffers(loaded.quantized_storage, family, y, *usage, family.expected(y, *usage))


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("name", ALL)
def test_bare_storage_round_trip(name, how):
    family = FAMILIES[name]
    storage = family.quantize(family_input(family), internal=True)
    loaded = ROUND_TRIPS[how](storage)
    assert not isinstance(loaded, torch.Tensor)
    assert_same_storage(loaded, storage, family)
    # the original keeps its float8 buffers (pickling views them as uint8 only in the state)
    for n in storage.tensor_fields():
        a, b = getattr(loaded, n), getattr(storage, n)
        if b is not None:
            assert a.dtype == b.dtype


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_requires_grad_and_parameters_survive(how):
    x = family_input(FAMILIES["mxfp8"])
    param = torch.nn.Parameter(mf.MXFP8Quantizer()(x))
    loaded = ROUND_TRIPS[how]({"w": param, "plain": torch.ones(2)})
    assert isinstance(loaded["w"], mf.QuantizedTensor)
    assert loaded["w"].requires_grad
    assert torch.equal(loaded["w"].dequantize(), param.dequantize())
    assert torch.equal(loaded["plain"], torch.ones(2))


def test_weights_only_load_after_a_fresh_import(tmp_path):
    """The safe globals are registered by `import minifloat` alone (run in a new interpreter)."""
    import subprocess
    import sys

    path = tmp_path / "t.pt"
    torch.save(
        {"mx": mf.MXFP8Quantizer()(torch.randn(32, 32)), "q": mf.NVFP4Quantizer(with_rht=True)},
        path,
    )
    code = (
        "import sys, torch, minifloat as mf\n"
        f"d = torch.load({str(path)!r}, weights_only=True)\n"
        "assert isinstance(d['mx'], mf.QuantizedTensor)\n"
        "assert d['q'].with_rht is True\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# --------------------------------------------------------------------------------------------
# quantizers and amax reduction groups
# --------------------------------------------------------------------------------------------


class _DummyGroup:
    """Stands in for a process group: pickling it must never be attempted."""

    def __reduce__(self):
        raise AssertionError("a reduction group was pickled")


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("name", ALL)
def test_quantizer_round_trip_drops_the_reduction_group(name, how):
    family = FAMILIES[name]
    q = family.quantizer(rowwise=True, columnwise=False, internal=True)
    group = _DummyGroup()
    q.amax_reduction_group = group
    loaded = ROUND_TRIPS[how](q)
    assert_same_quantizer(loaded, q)
    assert loaded.amax_reduction_group is None
    assert q.amax_reduction_group is group  # pickling did not change the live quantizer
    q.amax_reduction_group = lambda: None  # a lambda never reaches pickle either
    assert pickle_round_trip(q).amax_reduction_group is None


@pytest.mark.parametrize("name", NON_REDUCING)
def test_output_quantizer_never_carries_the_group(name):
    family = FAMILIES[name]
    q = family.quantizer()
    q.amax_reduction_group = _DummyGroup()
    x = family_input(family)
    out = q(x)
    assert out.quantizer.amax_reduction_group is None
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x))
    for how, round_trip in ROUND_TRIPS.items():
        loaded = round_trip(out)
        assert loaded.quantizer.amax_reduction_group is None, how


@pytest.mark.parametrize("name", sorted(REDUCING))
def test_reducing_families_with_a_real_group(name, one_rank_group):
    """With one rank the all-reduce is the identity: bytes equal the group-less reference, and
    neither the output's quantizer nor a pickle carries the group."""
    family = FAMILIES[name]
    q = family.quantizer()
    q.amax_reduction_group = one_rank_group
    x = family_input(family, seed=4)
    if family.stochastic:
        torch.manual_seed(1234)
    out = q(x)
    check_buffers(out.quantized_storage, family, x, True, True, family.expected(x))
    assert out.quantizer.amax_reduction_group is None
    assert q.amax_reduction_group is one_rank_group
    assert pickle_round_trip(q).amax_reduction_group is None
    assert torch_round_trip(out).quantizer.amax_reduction_group is None


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.Tensor, torch.Size, tuple)


@pytest.mark.parametrize("name", ALL)
def test_quantizers_and_storages_hold_plain_values_only(name):
    """DESIGN.md §1: never a process group, closure or module reference in what is pickled."""
    family = FAMILIES[name]
    q = family.quantizer()
    q.amax_reduction_group = lambda: None
    for key, value in q.__getstate__().items():
        assert isinstance(value, _PLAIN), f"quantizer field {key} holds {type(value).__name__}"
    out = q(family_input(family)) if name not in REDUCING else None
    if out is None:
        q.amax_reduction_group = None
        out = q(family_input(family))
    state = out.quantized_storage.__getstate__()
    for key, value in state.items():
        if key == "quantizer":
            assert isinstance(value, mf.Quantizer) and value.amax_reduction_group is None
            for k, v in value.__getstate__().items():
                assert isinstance(v, _PLAIN), f"output quantizer field {k}"
        elif key == "_fp8_fields":
            assert all(isinstance(v, torch.dtype) for v in value.values())
        else:
            assert isinstance(value, _PLAIN), f"storage field {key} holds {type(value).__name__}"
    pickle.dumps(out)  # a stray lambda or closure would raise here
    torch_round_trip(out)  # and an unknown global would be refused here
