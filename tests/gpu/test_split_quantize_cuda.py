"""split_quantize's multi-tensor path gives every split exactly what the per-split loop gives it:
the same result type (QuantizedTensor or internal storage), storage class, metadata, owner
quantizer and the same bytes in every buffer; and it takes one multi-kernel call for all splits.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (small shapes); skipped otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from minifloat import kernels

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip(
        "needs CUDA with Triton, or TRITON_INTERPRET=1 with Triton", allow_module_level=True
    )

import minifloat.kernels.multi_tensor as multi_tensor  # noqa: E402
import minifloat.kernels.mxfp8_multi as mxfp8_multi  # noqa: E402
import minifloat.kernels.nvfp4_multi as nvfp4_multi  # noqa: E402
from minifloat.quantizers import (  # noqa: E402
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedStorage,
    QuantizedTensor,
    Quantizer,
    as_storage,
)
from minifloat.quantizers.split import split_quantize  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
]

K = 32
KINDS: dict[str, Callable[..., Quantizer]] = {
    "current": lambda **u: Float8CurrentScalingQuantizer(**u),
    "current_e5m2": lambda **u: Float8CurrentScalingQuantizer(
        torch.float8_e5m2, amax_epsilon=1e-3, power_2_scale=True, **u),
    "block": lambda **u: Float8BlockQuantizer(1, **u),
    "block_plain_scale": lambda **u: Float8BlockQuantizer(
        1, power_2_scale=False, amax_epsilon=1e-4, **u),
    "nvfp4": lambda **u: NVFP4Quantizer(**u),
    "nvfp4_rht": lambda **u: NVFP4Quantizer(with_rht=True, **u),
    "mxfp8": lambda **u: MXFP8Quantizer(**u),
    "mxfp8_e5m2": lambda **u: MXFP8Quantizer(torch.float8_e5m2, **u),
}
# MXFP8 blocks span 32 rows (columnwise): its splits hold twice the rows of the others'
ROW_FACTOR = {"mxfp8": 2, "mxfp8_e5m2": 2}
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}
MULTI_FUNCTIONS = (
    (multi_tensor, "quantize_current_scaling_multi"),
    (multi_tensor, "quantize_block_1d_multi"),
    (nvfp4_multi, "quantize_nvfp4_multi"),
    (mxfp8_multi, "quantize_mxfp8_multi"),
)


@pytest.fixture
def multi_calls(monkeypatch) -> list[int]:
    """Counts multi-kernel calls (split_kernels imports them from their modules per call); each
    entry is the number of tensors of one call."""
    calls: list[int] = []
    for module, name in MULTI_FUNCTIONS:
        original = getattr(module, name)

        def spy(tensors, *args, _original=original, **kwargs):
            calls.append(len(tensors))
            return _original(tensors, *args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def make_input(splits: list[int], dtype: torch.dtype, k: int = K, seed: int = 0) -> torch.Tensor:
    """Rows of each split at their own magnitude (own scales); one outlier, one zero block."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(rows, k, generator=gen) * 2.0 ** (i % 7 - 3)
             for i, rows in enumerate(splits)]
    x = torch.cat(parts) if parts else torch.zeros(0, k)
    if x.shape[0] > 1:
        x[1, 3] = 300.0
        x[-1, :16] = 0.0
    return x.to(dtype).to(DEVICE)


def splits_for(kind: str, splits: list[int]) -> list[int]:
    """`splits` in rows the kind's format takes (MXFP8: multiples of 32)."""
    return [rows * ROW_FACTOR.get(kind, 1) for rows in splits]


def make_quantizers(kind: str, count: int, usage: str = "both") -> list[Quantizer]:
    """One quantizer per split, internal on even splits only: both result types in one call."""
    rowwise, columnwise = USAGES[usage]
    quantizers = [KINDS[kind](rowwise=rowwise, columnwise=columnwise) for _ in range(count)]
    for i, quantizer in enumerate(quantizers):
        quantizer.internal = i % 2 == 0
    return quantizers


def _same_buffer(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    assert (actual is None) == (expected is None), what
    if expected is None:
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert actual.device.type == DEVICE.type, what
    a = actual.contiguous().view(torch.uint8) if actual.dim() else actual.reshape(1)
    e = expected.contiguous().view(torch.uint8) if expected.dim() else expected.reshape(1)
    assert torch.equal(a.cpu(), e.cpu()), f"{what}: bytes differ"


def assert_same_results(
    multi: list, loop: list, *, compare_bytes: bool = True, skip: tuple[str, ...] = ()
) -> None:
    """Same result types, storage classes, metadata, owners and (unless told) buffer bytes."""
    assert len(multi) == len(loop)
    for i, (a, b) in enumerate(zip(multi, loop, strict=True)):
        assert type(a) is type(b), f"split {i}: {type(a).__name__} != {type(b).__name__}"
        if b is None:
            continue
        if isinstance(b, QuantizedTensor):
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), f"split {i}"
        sa, sb = as_storage(a), as_storage(b)
        assert isinstance(sb, QuantizedStorage) and type(sa) is type(sb), f"split {i}"
        assert (sa.shape, sa.dtype) == (sb.shape, sb.dtype), f"split {i}"
        for name in sb.metadata_fields:
            assert getattr(sa, name) == getattr(sb, name), f"split {i} {name}"
        qa, qb = sa.quantizer, sb.quantizer
        assert type(qa) is type(qb) and qa.format_signature() == qb.format_signature()
        assert (qa.rowwise_usage, qa.columnwise_usage, qa.internal) == (
            qb.rowwise_usage, qb.columnwise_usage, qb.internal)
        assert qa.amax_reduction_group is None and qb.amax_reduction_group is None
        for name in sb.tensor_fields():
            if name in skip:
                assert (getattr(sa, name) is None) == (getattr(sb, name) is None)
                assert getattr(sb, name) is None or (
                    getattr(sa, name).shape == getattr(sb, name).shape)
            elif compare_bytes:
                _same_buffer(getattr(sa, name), getattr(sb, name), f"split {i} {name}")


def both_paths(x, splits, quantizers, **kwargs):
    return (split_quantize(x, splits, quantizers, **kwargs),
            split_quantize(x, splits, quantizers, loop=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_multi_path_equals_the_loop(kind, usage, dtype, multi_calls):
    splits = splits_for(kind, [32, 0, 16, 48])  # uneven, one empty
    x = make_input(splits, dtype)
    multi, loop = both_paths(x, splits, make_quantizers(kind, len(splits), usage))
    assert multi_calls == [3], "one multi-kernel call for the three non-empty splits"
    assert multi[1] is None
    assert isinstance(multi[0], QuantizedStorage) and isinstance(multi[3], QuantizedTensor)
    assert_same_results(multi, loop)


@pytest.mark.parametrize("splits", [[48], [0, 0, 64, 0], [16, 16, 16]],
                         ids=["single", "one_of_four", "even"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_split_patterns(kind, splits, multi_calls):
    splits = splits_for(kind, splits)
    x = make_input(splits, torch.bfloat16, seed=1)
    multi, loop = both_paths(x, splits, make_quantizers(kind, len(splits)))
    busy = sum(1 for rows in splits if rows)
    # a split alone is quantized by its own quantizer's single-tensor kernel
    assert multi_calls == ([busy] if busy > 1 else [])
    assert_same_results(multi, loop)


@pytest.mark.parametrize("kind", ["current", "block", "nvfp4_rht", "mxfp8"])
def test_many_small_splits(kind, multi_calls):
    splits = splits_for(kind, [16 if i % 5 else 0 for i in range(64)])  # every fifth idle
    x = make_input(splits, torch.float32, k=16 * ROW_FACTOR.get(kind, 1), seed=2)
    multi, loop = both_paths(x, splits, make_quantizers(kind, len(splits)))
    assert multi_calls == [sum(1 for rows in splits if rows)]
    assert_same_results(multi, loop)


@pytest.mark.parametrize("kind", ["current", "block", "nvfp4", "mxfp8"])
def test_float16_and_3d_input(kind, multi_calls):
    splits = [16, 32]  # of [2, 32] rows: [32, 32] and [64, 32] matrices, MXFP8's too
    x = make_input(splits, torch.float16, k=64, seed=3).reshape(48, 2, 32)
    multi, loop = both_paths(x, splits, make_quantizers(kind, len(splits)))
    assert multi_calls == [2]
    assert as_storage(multi[1]).shape == (32, 2, 32)
    assert_same_results(multi, loop)


def test_environment_forces_the_loop(monkeypatch, multi_calls):
    splits = [16, 32]
    x = make_input(splits, torch.float32)
    monkeypatch.setenv("MINIFLOAT_SPLIT_LOOP", "1")
    forced = split_quantize(x, splits, make_quantizers("current", 2))
    assert multi_calls == []
    monkeypatch.delenv("MINIFLOAT_SPLIT_LOOP")
    assert_same_results(split_quantize(x, splits, make_quantizers("current", 2)), forced)
    assert multi_calls == [2]


@pytest.mark.parametrize("case", ["mixed_kinds", "mixed_settings", "block_2d",
                                  "mxfp8_mixed_dtypes", "mxfp8_mixed_usages"])
def test_fallback_takes_the_loop(case, multi_calls):
    splits = [32, 0, 64]
    quantizers = make_quantizers("current", 3)
    if case == "mixed_kinds":
        quantizers[2] = Float8BlockQuantizer(1)
    elif case == "mixed_settings":
        quantizers[2] = Float8CurrentScalingQuantizer(power_2_scale=True)
    elif case == "block_2d":
        quantizers = [Float8BlockQuantizer(2) for _ in splits]
    elif case == "mxfp8_mixed_dtypes":
        quantizers = [MXFP8Quantizer(), MXFP8Quantizer(), MXFP8Quantizer(torch.float8_e5m2)]
    else:
        quantizers = [MXFP8Quantizer(), MXFP8Quantizer(), MXFP8Quantizer(columnwise=False)]
    x = make_input(splits, torch.bfloat16)
    multi, loop = both_paths(x, splits, quantizers)
    assert multi_calls == []
    assert_same_results(multi, loop)


@pytest.mark.parametrize("kind,splits,multiple", [
    ("nvfp4", [24, 8], "16"),  # NVFP4 needs rows in multiples of 16
    ("mxfp8", [32, 16], "32"),  # MXFP8 in multiples of 32
])
def test_rejected_shapes_raise_the_loops_error(kind, splits, multiple, multi_calls):
    x = make_input(splits, torch.float32)
    with pytest.raises(ValueError, match=multiple):
        split_quantize(x, splits, make_quantizers(kind, 2))
    assert multi_calls == []


# ---- amax reduction groups ----


@pytest.fixture
def doubling_all_reduce(monkeypatch) -> list[tuple[object, tuple[int, ...]]]:
    """Stands in for torch.distributed.all_reduce: doubles the amax in place (a visible effect
    on the bytes) and records (group, shape) of each call."""
    import torch.distributed as dist

    calls: list[tuple[object, tuple[int, ...]]] = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append((group, tuple(tensor.shape)))
        tensor.mul_(2.0)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


@pytest.mark.parametrize("kind,per_kind", [("current", 1), ("nvfp4", 1), ("nvfp4_rht", 2)])
def test_shared_group_reduces_once_as_a_vector(kind, per_kind, multi_calls,
                                               doubling_all_reduce):
    splits = [32, 0, 16, 48]
    group = object()
    x = make_input(splits, torch.float32)
    quantizers = make_quantizers(kind, len(splits))
    for quantizer in quantizers:
        quantizer.amax_reduction_group = group
    multi = split_quantize(x, splits, quantizers)
    assert multi_calls == [3]
    assert doubling_all_reduce == [(group, (3,))] * per_kind
    doubling_all_reduce.clear()
    loop = split_quantize(x, splits, quantizers, loop=True)
    assert len(doubling_all_reduce) == 3 * per_kind
    assert_same_results(multi, loop)
    for quantizer in quantizers:
        quantizer.amax_reduction_group = None
    plain = split_quantize(x, splits, quantizers)
    amax_field = "scale_inv" if kind == "current" else "amax_rowwise"
    reduced, unreduced = (getattr(as_storage(r[0]), amax_field) for r in (multi, plain))
    assert not torch.equal(reduced.cpu(), unreduced.cpu()), "the reduction reached the bytes"


def test_different_groups_take_the_loop(multi_calls, doubling_all_reduce):
    splits = [16, 32]
    quantizers = make_quantizers("current", 2)
    quantizers[0].amax_reduction_group, quantizers[1].amax_reduction_group = object(), object()
    x = make_input(splits, torch.float32)
    multi, loop = both_paths(x, splits, quantizers)
    assert multi_calls == []
    assert len(doubling_all_reduce) == 4, "one reduction per split and path"
    assert_same_results(multi, loop)


@pytest.mark.parametrize("kind", ["block", "mxfp8"])
def test_formats_without_global_amax_ignore_groups(kind, multi_calls, doubling_all_reduce):
    splits = splits_for(kind, [16, 32])
    quantizers = make_quantizers(kind, 2)
    quantizers[0].amax_reduction_group = object()
    x = make_input(splits, torch.float32)
    multi, loop = both_paths(x, splits, quantizers)
    assert multi_calls == [2] and doubling_all_reduce == []
    assert_same_results(multi, loop)


# ---- stochastic rounding: not the loop's random bits, but the same scales and the NVFP4 error


def test_nvfp4_stochastic_rounding(multi_calls):
    splits = [32, 0, 64]
    x = make_input(splits, torch.float32, k=64, seed=4)
    quantizers = [NVFP4Quantizer(with_rht=True, stochastic_rounding=True, internal=True)
                  for _ in splits]
    torch.manual_seed(5)
    multi = split_quantize(x, splits, quantizers)
    torch.manual_seed(5)
    again = split_quantize(x, splits, quantizers)
    loop = split_quantize(x, splits, quantizers, loop=True)
    assert multi_calls == [2, 2]
    data = ("rowwise_data", "columnwise_data")
    assert_same_results(multi, again)  # reproducible under torch.manual_seed
    assert_same_results(multi, loop, skip=data)  # scales and amaxes do not depend on SR
    start = 0
    for rows, result in zip(splits, multi, strict=True):
        if rows == 0:
            assert result is None
            continue
        piece = x[start:start + rows].float().cpu()
        start += rows
        values = result.dequantize(torch.float32).cpu()
        # SR moves a value to one of its two neighbours on the scaled E2M1 grid: within one
        # grid step, at most 2/6 of the block's amax (with slack for the UE4M3 scale rounding)
        block_amax = piece.abs().reshape(rows, -1, 16).amax(-1, keepdim=True)
        error = (values - piece).abs().reshape(rows, -1, 16)
        assert bool((error <= block_amax * (2.0 / 6.0) * 1.15 + 1e-30).all())
        bias = (values - piece).mean().abs() / piece.abs().mean()
        assert float(bias) < 0.05, "stochastic rounding is unbiased on average"
