"""Per-tensor FP8: current scaling (NUMERICS.md §2) and the delayed-scaling update (§3).

References: numpy float32 arithmetic for the fp32 scale math (IEEE, one rounding per op), torch's
own float8 conversion of clamped values for the element bytes, and hand-computed values.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from minifloat.numerics import (
    FLT_MAX,
    compute_amax,
    delayed_scaling_update,
    dequantize_per_tensor,
    quantize_current_scaling,
    quantize_with_scale,
    scale_from_amax,
)

E4M3_DT = torch.float8_e4m3fn
E5M2_DT = torch.float8_e5m2
FP8_MAX = {E4M3_DT: 448.0, E5M2_DT: 57344.0}
F32 = np.float32



def f32_bits(v) -> int:
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


def ref_scale(amax, fp8_max, eps=0.0, pow2=False) -> float:
    """§2 steps 2-3 in numpy float32, scalar by scalar."""
    with np.errstate(all="ignore"):
        a = F32(amax)
        if a < F32(eps):
            a = F32(eps)
        if a == 0 or np.isinf(a) or np.isnan(a):
            s = F32(1.0)
        else:
            s = F32(fp8_max) / a  # one IEEE fp32 division
            if np.isinf(s):
                s = F32(FLT_MAX)
        if pow2:
            s = np.array([f32_bits(s) & 0xFF800000], dtype=np.uint32).view(np.float32)[0]
    return float(s)


def f32_recip(v) -> float:
    """1 / v rounded to fp32 (numpy: one IEEE division)."""
    return float(F32(1.0) / F32(v))


def torch_fp8_bytes(x32: torch.Tensor, dtype) -> torch.Tensor:
    mx = FP8_MAX[dtype]
    return torch.clamp(x32, -mx, mx).to(dtype).view(torch.uint8)


def ref_data_bytes(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """sat_rne(x * scale) with the product in numpy fp32, encoded by torch's converter."""
    with np.errstate(all="ignore"):
        prod = x.float().numpy() * F32(scale)
    return torch_fp8_bytes(torch.from_numpy(prod), dtype)


def assert_bytes_equal(got: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    """Byte equality, with any NaN encoding accepted where both are NaN."""
    got, expected = got.reshape(-1), expected.reshape(-1)
    if dtype == E4M3_DT:
        nan_g, nan_e = (got & 0x7F) == 0x7F, (expected & 0x7F) == 0x7F
    else:
        nan_g, nan_e = (got & 0x7F) > 0x7C, (expected & 0x7F) > 0x7C
    assert torch.equal(nan_g, nan_e)
    assert torch.equal(got[~nan_g], expected[~nan_e])


def log_uniform(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()


# ---------------------------------------------------------------- scale from amax


@pytest.mark.parametrize(
    "amax,fp8_max,expected",
    [
        (448.0, 448.0, 1.0),
        (7.0, 448.0, 64.0),  # 448 / 7 exactly
        (2.0, 448.0, 224.0),
        (0.5, 448.0, 896.0),
        (3.5, 448.0, 128.0),
        (2.0**-119, 448.0, 1.75 * 2.0**127),  # largest finite case: 448 * 2^119 < FLT_MAX
        (57344.0, 57344.0, 1.0),
        (7.0, 57344.0, 8192.0),
        (2.0**-3, 57344.0, 458752.0),
    ],
)
def test_scale_exact_known_values(amax, fp8_max, expected):
    s = scale_from_amax(torch.tensor(amax), fp8_max)
    assert s.dtype == torch.float32
    assert s.item() == expected == ref_scale(amax, fp8_max)


@pytest.mark.parametrize(
    "amax,expected",
    [
        (0.0, 1.0),
        (math.inf, 1.0),
        (math.nan, 1.0),
        (2.0**-120, FLT_MAX),  # 448 * 2^120 = 1.75 * 2^128 overflows -> FLT_MAX
        (2.0**-127, FLT_MAX),
        (1e-45, FLT_MAX),  # fp32 min subnormal
        (1e-39, FLT_MAX),
    ],
)
def test_scale_degenerate_amax(amax, expected):
    s = scale_from_amax(torch.tensor(amax), 448.0)
    assert s.item() == expected == ref_scale(amax, 448.0)
    assert torch.isfinite(s)


def test_scale_elementwise_over_a_grid_of_amaxes():
    amax = torch.tensor([[0.0, math.inf], [math.nan, 2.0]])
    assert scale_from_amax(amax, 448.0).tolist() == [[1.0, 1.0], [1.0, 224.0]]


def test_scale_is_one_fp32_division_448_over_3():
    # 448 / 3: exact quotient 149.3333...; fp32 RNE -> 0x43155555 (149.33333). The reciprocal
    # route fp32(1/3) * 448 = 0.33333334 * 448 rounds to 0x43155556 (149.33334); `448 / tensor`
    # in torch takes that route (Tensor.__rdiv__ is reciprocal() * other), a bug this caught.
    s = scale_from_amax(torch.tensor(3.0), 448.0)
    assert f32_bits(s.item()) == 0x43155555


def test_one_division_matters_for_bytes():
    # amax 3 -> scale fp32(448/3) = 149.33333; x1 * 149.33333 = 2^-10 exactly in fp32, the tie
    # between 0 and 2^-9 -> even 0 (0x00). With 149.33334 the product is 2^-10 (1 + 1.2e-7),
    # past the tie -> 2^-9 (0x01).
    x1 = 6.5394810917496216e-06
    assert float(F32(x1) * F32(F32(448.0) / F32(3.0))) == 2.0**-10
    data, _ = quantize_current_scaling(torch.tensor([3.0, x1]), E4M3_DT)
    assert data.view(torch.uint8).tolist() == [0x7E, 0x00]


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
def test_scale_is_one_fp32_division_random(dtype):
    amax = torch.cat((log_uniform(2000, -60, 60, seed=1), torch.tensor([3.0, 1.7, 449.0])))
    got = scale_from_amax(amax, FP8_MAX[dtype]).tolist()
    expected = [ref_scale(a, FP8_MAX[dtype]) for a in amax.tolist()]
    assert got == expected


@pytest.mark.parametrize(
    "amax,eps,expected",
    [
        (1e-3, 1.0, 448.0),  # raised to eps = 1
        (2.0, 1.0, 224.0),  # above eps: untouched
        (0.75, 1.0, 448.0),  # just below eps: raised to 1 (not 448 / 0.75 = 597.33)
        (1.0, 1.0, 448.0),  # at eps
        (0.0, 0.5, 896.0),  # zero amax raised to eps, then divided
        (0.0, 0.0, 1.0),
        (math.nan, 1.0, 1.0),  # NaN is not < eps: still the NaN rule
        (math.inf, 1.0, 1.0),
        (2.0**-130, 2.0**-4, 7168.0),  # 448 * 16
    ],
)
def test_amax_epsilon(amax, eps, expected):
    s = scale_from_amax(torch.tensor(amax), 448.0, amax_epsilon=eps)
    assert s.item() == expected == ref_scale(amax, 448.0, eps)


def test_amax_epsilon_in_quantize():
    x = torch.full((4, 4), 1e-6)
    data, scale_inv = quantize_current_scaling(x, E4M3_DT, amax_epsilon=0.5)
    assert scale_inv.item() == f32_recip(896.0)  # scale = 448 / 0.5
    # 1e-6 * 896 = 8.96e-4 < 2^-10 (half the min subnormal): flushes to zero
    assert (data.view(torch.uint8) == 0).all()


@pytest.mark.parametrize(
    "amax,expected",
    [
        (3.0, 128.0),  # 149.33 -> 128
        (1.0, 256.0),  # 448 -> 256
        (448.0, 1.0),
        (500.0, 0.5),  # 0.896 -> 0.5
        (1e-3, 262144.0),  # 448000 -> 2^18
        (1e-45, 2.0**127),  # FLT_MAX -> 2^127
        (0.0, 1.0),
    ],
)
def test_power_2_scale_known(amax, expected):
    s = scale_from_amax(torch.tensor(amax), 448.0, power_2_scale=True)
    assert s.item() == expected == ref_scale(amax, 448.0, pow2=True)


def test_power_2_scale_random():
    amax = log_uniform(5000, -100, 100, seed=2)
    s = scale_from_amax(amax, 448.0, power_2_scale=True)
    assert ((s.view(torch.int32) & 0x7FFFFF) == 0).all()  # 23 mantissa bits cleared
    expected = [ref_scale(a, 448.0, pow2=True) for a in amax.tolist()]
    assert s.tolist() == expected
    true_q = (448.0 / amax.double())
    assert ((s.double() <= true_q * (1 + 2**-23)) & (true_q < 2 * s.double())).all()


def test_power_2_scale_huge_amax():
    # 448 / amax = 2^-119 exactly; the reciprocal route (fp32(1/amax) is subnormal there) lands
    # below 2^-119 and would round the power-of-2 scale down to 2^-120
    amax = 1.75 * 2.0**127  # 2.9774707e38, representable in bf16 and fp32
    s = scale_from_amax(torch.tensor(amax), 448.0, power_2_scale=True)
    assert s.item() == 2.0**-119 == ref_scale(amax, 448.0, pow2=True)


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
@pytest.mark.parametrize("scale", [149.33333, 0.0123, 3.0e5, 1.0, 2.0**-20])
def test_quantize_with_scale_bytes(dtype, scale):
    g = torch.Generator().manual_seed(3)
    x = torch.cat(
        (
            torch.randn(4000, generator=g) * 10.0 ** torch.randint(-6, 4, (4000,), generator=g),
            torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, FLT_MAX, 1e-45, -1e-45]),
        )
    ).reshape(8, -1)
    s = torch.tensor(scale, dtype=torch.float32)
    data, scale_inv = quantize_with_scale(x, s, dtype)
    assert data.dtype == dtype and data.shape == x.shape
    assert_bytes_equal(data.view(torch.uint8), ref_data_bytes(x, s.item(), dtype), dtype)
    assert scale_inv.item() == f32_recip(s.item())


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
def test_current_scaling_bytes(dtype):
    # amax = 4 exactly (a power of two, so 448/4 = 112 and 57344/4 = 14336 are exact)
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(64, 96, generator=g) * 2 - 1) * 4.0
    x[::7, ::5] *= 1e-4  # a spread of magnitudes, some into the subnormal range
    x[3, 17] = -4.0
    data, scale_inv = quantize_current_scaling(x, dtype)
    scale = FP8_MAX[dtype] / 4.0
    assert scale_inv.shape == () and scale_inv.item() == f32_recip(scale)
    assert_bytes_equal(data.view(torch.uint8), ref_data_bytes(x, scale, dtype), dtype)


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_current_scaling_bytes_random_amax(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    magnitude = float(torch.exp2(torch.randint(-20, 20, (1,), generator=g)))
    x = torch.randn(48, 80, generator=g) * magnitude
    x[::5, ::3] *= 1e-3
    amax = x.abs().max().item()
    data, scale_inv = quantize_current_scaling(x, dtype)
    scale = ref_scale(amax, FP8_MAX[dtype])
    assert scale_inv.item() == f32_recip(scale)
    assert_bytes_equal(data.view(torch.uint8), ref_data_bytes(x, scale, dtype), dtype)


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
def test_current_scaling_bf16_input(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=g).clamp(-7.9, 7.9).to(torch.bfloat16)
    x[0, 0] = 8.0  # amax 8
    data, scale_inv = quantize_current_scaling(x, dtype)
    scale = FP8_MAX[dtype] / 8.0
    assert scale_inv.item() == f32_recip(scale)
    assert_bytes_equal(data.view(torch.uint8), ref_data_bytes(x, scale, dtype), dtype)


def test_current_scaling_ties_with_unit_scale():
    # amax = 448 -> scale 1, so the elements are rounded as given (bytes hand-computed)
    x = torch.tensor([448.0, 1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), 0.0, -0.0,
                      2.0**-149, 240.0])
    data, scale_inv = quantize_current_scaling(x, E4M3_DT)
    assert scale_inv.item() == 1.0
    assert data.view(torch.uint8).tolist() == [
        0x7E, 0x38, 0xBA, 0x00, 0x02, 0x80, 0x00, 0x80, 0x00, 0x77
    ]


def test_current_scaling_one_huge_value():
    # amax 8192 -> scale 448/8192 = 0.0546875 (exact); 1e-3 * 0.0546875 = 5.5e-5 < 2^-10 -> 0
    x = torch.full((16, 16), 1e-3)
    x[5, 9] = -8192.0
    data, scale_inv = quantize_current_scaling(x, E4M3_DT)
    b = data.view(torch.uint8).clone()
    assert scale_inv.item() == f32_recip(0.0546875)
    assert int(b[5, 9]) == 0xFE
    b[5, 9] = 0
    assert (b == 0).all()
    deq = dequantize_per_tensor(data, scale_inv)
    assert deq[5, 9].item() == float(F32(-448.0) * F32(scale_inv.item()))
    assert deq[0, 0].item() == 0.0


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
def test_zeros_give_unit_scale(dtype):
    x = torch.tensor([[0.0, -0.0], [0.0, 0.0]])
    data, scale_inv = quantize_current_scaling(x, dtype)
    assert scale_inv.item() == 1.0
    assert data.view(torch.uint8).tolist() == [[0x00, 0x80], [0x00, 0x00]]
    assert (dequantize_per_tensor(data, scale_inv) == 0).all()


def test_inf_input_gives_unit_scale_and_saturates():
    x = torch.tensor([1.0, math.inf, -2.0, -math.inf])
    data, scale_inv = quantize_current_scaling(x, E4M3_DT)
    assert scale_inv.item() == 1.0
    # 1 -> 0x38, inf -> 448 = 0x7E, -2 -> 1 1000 000 = 0xC0, -inf -> 0xFE
    assert data.view(torch.uint8).tolist() == [0x38, 0x7E, 0xC0, 0xFE]
    data5, _ = quantize_current_scaling(x, E5M2_DT)
    assert data5.view(torch.uint8).tolist() == [0x3C, 0x7B, 0xC0, 0xFB]


@pytest.mark.parametrize("dtype", [E4M3_DT, E5M2_DT])
@pytest.mark.parametrize("extra", [[], [math.inf], [1e30, -1e-30]])
def test_nan_input_never_becomes_finite(dtype, extra):
    x = torch.tensor([1.0, math.nan, -3.0] + extra)
    data, scale_inv = quantize_current_scaling(x, dtype)
    deq = dequantize_per_tensor(data, scale_inv)
    assert torch.isnan(deq[1])
    assert torch.isfinite(deq[[0, 2]]).all()


def test_dequantize_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in (E4M3_DT, E5M2_DT):
        deq = dequantize_per_tensor(b.view(dtype), torch.tensor(0.5), torch.float32)
        ref = b.view(dtype).double() * 0.5  # torch decodes the byte; * 0.5 is exact
        same = (deq.double() == ref) | (torch.isnan(deq) & torch.isnan(ref))
        assert same.all()
    out = dequantize_per_tensor(torch.tensor([0x38], dtype=torch.uint8).view(E4M3_DT),
                                torch.tensor(3.0), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.item() == 3.0


def test_quantize_dequantize_error_bound():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(128, 128, generator=g)
    x[0, 0] = 8.0  # amax 8 (larger than any randn draw here), scale 56 exact
    data, scale_inv = quantize_current_scaling(x, E4M3_DT)
    deq = dequantize_per_tensor(data, scale_inv)
    # E4M3 RNE: relative error <= 2^-4 for normals; absolute <= 2^-10 / scale for subnormals
    bound = x.abs() * 2.0**-4 + 2.0**-10 / 56.0
    assert ((deq - x).abs() <= bound).all()


def test_compute_amax():
    assert compute_amax(torch.tensor([-3.0, 2.0])).item() == 3.0
    a = compute_amax(torch.tensor([[1.0, -7.5]], dtype=torch.bfloat16))
    assert a.dtype == torch.float32 and a.shape == () and a.item() == 7.5
    assert math.isnan(compute_amax(torch.tensor([1.0, math.nan])).item())
    assert compute_amax(torch.tensor([1.0, -math.inf])).item() == math.inf
    empty = compute_amax(torch.zeros(0, 4))
    assert empty.shape == () and empty.item() == 0.0


# ---------------------------------------------------------------- delayed scaling


def history():
    # rows = history positions (row 0 = newest), columns = slots
    return torch.tensor(
        [[1.0, 2.0, 0.0], [4.0, 1.0, 0.0], [2.0, 8.0, 0.0], [0.5, 0.25, 0.0]]
    )


def test_delayed_max_and_roll():
    h = history()
    new_h, new_s = delayed_scaling_update(h, torch.tensor([5.0, 6.0, 7.0]), 448.0)
    # max over history: [4, 8, 0] -> 448/4 = 112, 448/8 = 56, amax 0 keeps the old scale 7
    assert new_s.tolist() == [112.0, 56.0, 7.0]
    # roll: newest (row 0) moves to the end, row 1 becomes row 0 and is zeroed
    assert new_h.tolist() == [
        [0.0, 0.0, 0.0], [2.0, 8.0, 0.0], [0.5, 0.25, 0.0], [1.0, 2.0, 0.0]
    ]


def test_delayed_most_recent():
    _, new_s = delayed_scaling_update(
        history(), torch.tensor([5.0, 6.0, 7.0]), 448.0, amax_compute_algo="most_recent"
    )
    assert new_s.tolist() == [448.0, 224.0, 7.0]  # slot-0 amaxes [1, 2, 0]


def test_delayed_margin():
    _, new_s = delayed_scaling_update(history(), torch.tensor([5.0, 6.0, 7.0]), 448.0, margin=2)
    assert new_s.tolist() == [28.0, 14.0, 7.0]  # (448/4)/4, (448/8)/4, kept


def test_delayed_per_slot_max():
    h = torch.tensor([[4.0, 8.0, 2.0]])
    _, new_s = delayed_scaling_update(h, torch.ones(3), torch.tensor([448.0, 57344.0, 448.0]))
    assert new_s.tolist() == [112.0, 7168.0, 224.0]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_keeps_old_scale_for_bad_amax(algo):
    h = torch.tensor([[0.0, math.inf, math.nan, -1.0, 1e-45, 2.0]])
    h = torch.cat((h, torch.zeros_like(h), -torch.ones_like(h)))
    old = torch.tensor([3.0, 5.0, 9.0, 11.0, 13.0, 17.0])
    new_h, new_s = delayed_scaling_update(h, old, 448.0, amax_compute_algo=algo)
    # 0, inf, NaN, -1: keep; 1e-45: 448/1e-45 = inf -> FLT_MAX; 2: 224
    assert new_s.tolist() == [3.0, 5.0, 9.0, 11.0, FLT_MAX, 224.0]
    assert torch.isfinite(new_s).all()
    assert (new_h[0] == 0).all()


def test_delayed_history_len_one():
    h = torch.tensor([[2.0, 0.0]])
    new_h, new_s = delayed_scaling_update(h, torch.tensor([1.0, 1.0]), 448.0)
    assert new_h.tolist() == [[0.0, 0.0]] and new_s.tolist() == [224.0, 1.0]


def test_delayed_bad_algo():
    with pytest.raises(ValueError, match="amax_compute_algo"):
        delayed_scaling_update(history(), torch.ones(3), 448.0, amax_compute_algo="mean")


def test_delayed_scale_is_one_fp32_division():
    amax = torch.cat((torch.tensor([3.0]), log_uniform(500, -30, 30, seed=7)))
    h = amax.reshape(1, -1)
    _, new_s = delayed_scaling_update(h, torch.ones_like(amax), 448.0, margin=1)
    expected = [float(F32(F32(448.0) / F32(a)) / F32(2.0)) for a in amax.tolist()]
    assert new_s.tolist() == expected
