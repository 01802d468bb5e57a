"""Which split_quantize calls go to the multi-tensor kernels (plan_multi) and which loop.

No kernel runs here (CPU CI has no Triton): kernels.available is patched to say yes or no, and
the plan is inspected, or run_plan replaced by a recorder. The bytes of the multi path against
the loop are tested in tests/gpu/test_split_quantize_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

import minifloat.quantizers.split as split_module
from minifloat import kernels
from minifloat.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedStorage,
    QuantizedTensor,
)
from minifloat.quantizers.split import split_quantize
from minifloat.quantizers.split_kernels import plan_multi

SPLITS = [32, 0, 16, 48]


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda x: True)


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda x: False)


def x_for(splits=SPLITS, k=32, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(sum(splits), k, generator=torch.Generator().manual_seed(0)).to(dtype)


def same(make, splits=SPLITS):
    return [make() for _ in splits]


@pytest.mark.parametrize("make,kind", [
    (lambda: Float8CurrentScalingQuantizer(), "current_scaling"),
    (lambda: Float8CurrentScalingQuantizer(torch.float8_e5m2, amax_epsilon=1e-3,
                                           power_2_scale=True), "current_scaling"),
    (lambda: Float8BlockQuantizer(1), "block_1d"),
    (lambda: NVFP4Quantizer(), "nvfp4_1d"),
    (lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True), "nvfp4_1d"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_supported_configurations_plan_one_call(kernels_on, make, kind, dtype):
    plan = plan_multi(x_for(dtype=dtype), SPLITS, same(make))
    assert plan is not None and plan.kind == kind
    assert plan.indices == [0, 2, 3], "empty splits are not quantized"
    assert [tuple(p.shape) for p in plan.pieces] == [(32, 32), (16, 32), (48, 32)]


MX_SPLITS = [32, 0, 64, 96]  # MXFP8: rows in multiples of 32


@pytest.mark.parametrize("make", [
    lambda: MXFP8Quantizer(),
    lambda: MXFP8Quantizer(torch.float8_e5m2, rowwise=False),
    lambda: MXFP8Quantizer(columnwise=False, internal=True),
], ids=["e4m3_both", "e5m2_columnwise", "rowwise_internal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mxfp8_plans_one_call(kernels_on, make, dtype):
    plan = plan_multi(x_for(MX_SPLITS, dtype=dtype), MX_SPLITS, same(make, MX_SPLITS))
    assert plan is not None and plan.kind == "mxfp8"
    assert plan.indices == [0, 2, 3]
    assert [tuple(p.shape) for p in plan.pieces] == [(32, 32), (64, 32), (96, 32)]


def test_mxfp8_rules(kernels_on):
    x = x_for(MX_SPLITS)
    mixed_dtype = same(MXFP8Quantizer, MX_SPLITS)
    mixed_dtype[2] = MXFP8Quantizer(torch.float8_e5m2)
    assert plan_multi(x, MX_SPLITS, mixed_dtype) is None, "E4M3 next to E5M2: the loop"
    mixed_usage = same(MXFP8Quantizer, MX_SPLITS)
    mixed_usage[3].set_usage(rowwise=False)
    assert plan_multi(x, MX_SPLITS, mixed_usage) is None, "different usages: the loop"
    mixed_kind = same(MXFP8Quantizer, MX_SPLITS)
    mixed_kind[0] = Float8BlockQuantizer(1)
    assert plan_multi(x, MX_SPLITS, mixed_kind) is None, "MXFP8 next to block FP8: the loop"
    grouped = same(MXFP8Quantizer, MX_SPLITS)
    grouped[0].amax_reduction_group = object()  # MXFP8 never reduces an amax
    assert plan_multi(x, MX_SPLITS, grouped) is not None
    # rows (16, 48) or K (48) not multiples of 32: the loop, which raises the format's error
    assert plan_multi(x_for(), SPLITS, same(MXFP8Quantizer)) is None, "M % 32"
    assert plan_multi(x_for(MX_SPLITS, k=48), MX_SPLITS, same(MXFP8Quantizer, MX_SPLITS)) is None


def test_quantizers_of_empty_splits_do_not_count(kernels_on):
    quantizers = same(Float8CurrentScalingQuantizer)
    quantizers[1] = MXFP8Quantizer()  # its split is empty: never called
    assert plan_multi(x_for(), SPLITS, quantizers) is not None


def test_usages_internal_flags_may_differ_only_in_internal(kernels_on):
    quantizers = same(Float8CurrentScalingQuantizer)
    quantizers[0].internal = True
    assert plan_multi(x_for(), SPLITS, quantizers) is not None
    quantizers[3].set_usage(columnwise=False)
    assert plan_multi(x_for(), SPLITS, quantizers) is None


def _delayed() -> Float8Quantizer:
    return Float8Quantizer(torch.ones(1), torch.zeros(1))


class _SubclassedCurrentScaling(Float8CurrentScalingQuantizer):
    """Stands for a subclass that may quantize differently: it keeps its own path."""


UNSUPPORTED = {
    "mixed_kinds": lambda: [Float8CurrentScalingQuantizer(), None, Float8BlockQuantizer(1),
                            Float8CurrentScalingQuantizer()],
    "mixed_settings": lambda: [Float8CurrentScalingQuantizer(), None,
                               Float8CurrentScalingQuantizer(amax_epsilon=1e-6),
                               Float8CurrentScalingQuantizer()],
    "mixed_fp8_dtype": lambda: [Float8CurrentScalingQuantizer(), None,
                                Float8CurrentScalingQuantizer(torch.float8_e5m2),
                                Float8CurrentScalingQuantizer()],
    "mixed_rht": lambda: [NVFP4Quantizer(), None, NVFP4Quantizer(with_rht=True),
                          NVFP4Quantizer()],
    "delayed_scaling": lambda: same(_delayed),
    "block_2d": lambda: same(lambda: Float8BlockQuantizer(2)),
    "nvfp4_2d": lambda: same(lambda: NVFP4Quantizer(with_2d_quantization=True)),
    "identity": lambda: same(IdentityQuantizer),
    "hybrid": lambda: same(lambda: HybridQuantizer(Float8CurrentScalingQuantizer(),
                                                   Float8CurrentScalingQuantizer())),
    "subclass": lambda: same(_SubclassedCurrentScaling),
    "no_usage": lambda: same(lambda: Float8CurrentScalingQuantizer(rowwise=False,
                                                                   columnwise=False)),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_quantizers_loop(kernels_on, case):
    quantizers = UNSUPPORTED[case]()
    quantizers[1] = quantizers[1] or Float8CurrentScalingQuantizer()
    assert plan_multi(x_for(), SPLITS, quantizers) is None


def test_reduction_groups(kernels_on):
    group, other = object(), object()
    quantizers = same(Float8CurrentScalingQuantizer)
    for quantizer in quantizers:
        quantizer.amax_reduction_group = group
    assert plan_multi(x_for(), SPLITS, quantizers) is not None, "one shared group: one call"
    quantizers[1].amax_reduction_group = other  # the empty split's: irrelevant
    assert plan_multi(x_for(), SPLITS, quantizers) is not None
    quantizers[2].amax_reduction_group = other
    assert plan_multi(x_for(), SPLITS, quantizers) is None, "different groups: the loop"
    quantizers[2].amax_reduction_group = None
    assert plan_multi(x_for(), SPLITS, quantizers) is None, "group next to none: the loop"
    blocks = same(lambda: Float8BlockQuantizer(1))
    blocks[0].amax_reduction_group = group  # block 1D never reduces an amax
    assert plan_multi(x_for(), SPLITS, blocks) is not None


def test_inputs_the_kernels_do_not_take_loop(kernels_on):
    quantizers = same(Float8CurrentScalingQuantizer)
    wide = torch.randn(96, 64)
    assert plan_multi(wide[:, :32], SPLITS, quantizers) is None, "non-contiguous"
    assert plan_multi(x_for().double(), SPLITS, quantizers) is None, "float64"
    assert plan_multi(x_for(k=0), SPLITS, quantizers) is None, "zero elements per row"
    assert plan_multi(x_for([0, 0, 0, 0]), [0, 0, 0, 0], quantizers) is None, "nothing to do"
    nvfp4 = same(NVFP4Quantizer, [24, 0, 8, 64])
    assert plan_multi(x_for([24, 0, 8, 64]), [24, 0, 8, 64], nvfp4) is None, "M % 16"
    assert plan_multi(x_for(k=24), SPLITS, same(NVFP4Quantizer)) is None, "K % 16"


def test_no_kernels_no_plan(kernels_off):
    assert plan_multi(x_for(), SPLITS, same(Float8CurrentScalingQuantizer)) is None


@pytest.fixture
def recorded_runs(monkeypatch, kernels_on) -> list:
    """run_plan replaced by a recorder returning a marker list (no kernel runs)."""
    runs = []

    def fake_run(plan, count):
        runs.append((plan.kind, count))
        return ["multi"] * count

    monkeypatch.setattr(split_module, "run_plan", fake_run)
    return runs


def test_split_quantize_takes_the_plan(recorded_runs):
    assert split_quantize(x_for(), SPLITS, same(Float8BlockQuantizer)) == ["multi"] * 4
    mxfp8 = same(MXFP8Quantizer, MX_SPLITS)
    assert split_quantize(x_for(MX_SPLITS), MX_SPLITS, mxfp8) == ["multi"] * 4
    assert recorded_runs == [("block_1d", 4), ("mxfp8", 4)]


def test_loop_keyword_and_environment_force_the_loop(kernels_off, monkeypatch):
    consulted = []

    def spy(x, splits, quantizers):
        consulted.append(len(splits))

    monkeypatch.setattr(split_module, "plan_multi", spy)
    quantizers = same(Float8CurrentScalingQuantizer)
    assert split_quantize(x_for(), SPLITS, quantizers, loop=True)[1] is None
    monkeypatch.setenv("MINIFLOAT_SPLIT_LOOP", "1")
    assert isinstance(split_quantize(x_for(), SPLITS, quantizers)[0], QuantizedTensor)
    assert consulted == [], "the plan is not even consulted"
    monkeypatch.delenv("MINIFLOAT_SPLIT_LOOP")
    split_quantize(x_for(), SPLITS, quantizers)
    assert consulted == [4]


def test_the_loop_without_kernels(kernels_off):
    """The CPU path: each split's own quantizer call; None for empty splits."""
    quantizers = same(Float8CurrentScalingQuantizer)
    quantizers[0].internal = True
    results = split_quantize(x_for(), SPLITS, quantizers)
    assert results[1] is None
    assert isinstance(results[0], QuantizedStorage) and isinstance(results[2], QuantizedTensor)
    assert tuple(results[3].shape) == (48, 32)


def test_split_errors_come_first(kernels_on):
    with pytest.raises(ValueError, match="cover the input"):
        split_quantize(x_for(), [1, 2, 3, 4], same(Float8CurrentScalingQuantizer))
