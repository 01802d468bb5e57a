"""kernels/grouped_gemm.py's grouped FP8 GEMMs with device-side group ends against an
independent float64 computation: each group's FP8 values (exact) multiplied group by group,
times its two scales, then rounded to the output dtype.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 with triton installed; skipped elsewhere.
Every pair of E4M3/E5M2 operands (HYBRID's gradients are E5M2), an empty group, a group that
ends the buffer with extra zero rows, and both accumulation settings. The GEMM's summation order
is its own, so results agree to one rounding of the output dtype, not bitwise; the bound below
(bf16: 2^-8 relative) fails on a wrong group, scale, offset or transpose (errors of order 1).
"""

from __future__ import annotations

import pytest
import torch

from gpu.fp8_codes import canonical_nan
from minifloat.kernels import kernel_device

DEVICE = kernel_device()
if DEVICE is None:
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 with triton installed", allow_module_level=True)

grouped_gemm = pytest.importorskip("minifloat.kernels.grouped_gemm")

if DEVICE.type == "cpu":
    # Triton 3.6's interpreter turns a runtime loop bound into an int with int(array of shape
    # (1,)), which numpy 2 refuses; the kernels' loops run over runtime bounds (the groups'
    # ends). Read the one element instead, for this module's kernels under the interpreter.
    import numpy as np
    from triton.runtime import interpreter

    _patch_tensor = interpreter._patch_lang_tensor

    def _patch_tensor_with_index(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_tensor_with_index

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
GROUP_ROWS = grouped_gemm.GROUP_ROWS
# a bf16 result rounds to nearest on the GPU (half an ulp: 2^-9 relative at worst), but the
# interpreter's fp32 -> bf16 conversion truncates (a whole ulp)
BF16_BOUND = 2**-8 if DEVICE.type == "cuda" else 2**-7
# an fp32 result: sm90's FP8 MMA adds its products at less than fp32's precision (an H200
# measured 4e-5 at depth 64); the interpreter multiplies in fp32
FP32_BOUND = 2e-4 if DEVICE.type == "cuda" else 1e-6


def fp8_values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 8).to(dtype)


def layout(counts):
    """Group ends for per-group row counts (multiples of GROUP_ROWS), and the rows of each."""
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    starts = [int(e) - c for e, c in zip(ends, counts, strict=True)]
    return ends, [slice(s, s + c) for s, c in zip(starts, counts, strict=True)]


def relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("a_dtype", FP8)
@pytest.mark.parametrize("b_dtype", FP8)
@pytest.mark.parametrize("precise", [False, True])
def test_rows_gemm_each_group_through_its_own_weight(a_dtype, b_dtype, precise):
    counts = [GROUP_ROWS, 0, 2 * GROUP_ROWS, GROUP_ROWS]  # an empty group
    ends, rows = layout(counts)
    depth, width = 96, 80  # not multiples of the blocks: masked edges
    a = fp8_values((sum(counts), depth), a_dtype, 0)
    b = fp8_values((len(counts), width, depth), b_dtype, 1)
    a_scale = torch.tensor([0.5, 3.0, 0.25, 2.0])
    b_scale = torch.tensor([0.125, 1.0, 4.0, 0.75])
    out = grouped_gemm.grouped_rows_gemm(
        a.to(DEVICE), b.to(DEVICE), a_scale.to(DEVICE), b_scale.to(DEVICE), ends.to(DEVICE),
        torch.bfloat16, precise=precise).cpu()
    assert out.shape == (sum(counts), width) and out.dtype == torch.bfloat16
    for g, piece in enumerate(rows):
        if counts[g] == 0:
            continue
        want = (a[piece].double() @ b[g].double().t()) * (a_scale[g].double() * b_scale[g])
        assert relative_error(out[piece], want) < BF16_BOUND


def test_rows_gemm_strided_operands_and_rows_past_the_last_group():
    """b as the transposed view of [E, D, W] bytes and as the experts' transposed weight copy
    (expert e's [W, D] the columns e * D .. (e + 1) * D of one [W, E * D] matrix:
    grouped_offsets.expert_copies, what the dgrad reads), output fp32, and rows after the last
    group's end written as zeros."""
    counts = [GROUP_ROWS, GROUP_ROWS]
    ends, rows = layout(counts)
    total = sum(counts) + GROUP_ROWS
    a = fp8_values((total, 64), torch.float8_e5m2, 2)
    b_t = fp8_values((2, 64, 48), torch.float8_e4m3fn, 3)  # [E, D, W]
    columns = b_t.permute(2, 0, 1).reshape(48, 2 * 64).contiguous()  # [W, E * D]
    scales = torch.tensor([1.5, 0.5])
    for b in (b_t.to(DEVICE).transpose(1, 2),
              columns.to(DEVICE).view(48, 2, 64).transpose(0, 1)):
        out = grouped_gemm.grouped_rows_gemm(
            a.to(DEVICE), b, scales.to(DEVICE), scales.to(DEVICE), ends.to(DEVICE),
            torch.float32, precise=True).cpu()
        for g, piece in enumerate(rows):
            want = (a[piece].double() @ b_t[g].double()) * (scales[g].double() ** 2)
            assert relative_error(out[piece], want) < FP32_BOUND
        assert torch.equal(out[sum(counts):], torch.zeros(GROUP_ROWS, 48))


@pytest.mark.parametrize("a_dtype", FP8)
@pytest.mark.parametrize("precise", [False, True])
def test_reduction_gemm_sums_each_groups_rows(a_dtype, precise):
    counts = [2 * GROUP_ROWS, 0, GROUP_ROWS]
    ends, rows = layout(counts)
    a = fp8_values((40, sum(counts)), a_dtype, 4)  # dy^T [N, R]
    b = fp8_values((72, sum(counts)), torch.float8_e4m3fn, 5)  # x^T [K, R]
    a_scale = torch.tensor([0.5, float("nan"), 2.0])  # an empty group's scale is never read
    b_scale = torch.tensor([0.25, 1.0, 3.0])
    out = grouped_gemm.grouped_reduction_gemm(
        a.to(DEVICE), b.to(DEVICE), a_scale.to(DEVICE), b_scale.to(DEVICE), ends.to(DEVICE),
        torch.bfloat16, precise=precise).cpu()
    assert out.shape == (3, 40, 72)
    assert torch.equal(out[1], torch.zeros(40, 72, dtype=torch.bfloat16))
    for g in (0, 2):
        want = (a[:, rows[g]].double() @ b[:, rows[g]].double().t()) * (
            a_scale[g].double() * b_scale[g])
        assert relative_error(out[g], want) < BF16_BOUND


def test_rows_gemm_blocks_deeper_than_the_split_accumulator(monkeypatch):
    """A BLOCK_K deeper than SPLIT_ACCUMULATION (grouped_gemm_bench.py --sweep times 256 on a
    GPU; the kernel then promotes twice a block) sums every group right, the masked last block
    included."""
    tiles = grouped_gemm._tiles

    def deep(device, stages, element_size=1):
        chosen = tiles(device, stages, element_size)
        if DEVICE.type != "cuda":
            return chosen | dict(BLOCK_K=2 * chosen["BLOCK_K"])
        # two stages, as the sweep times it: four of 256-deep blocks need 256 KiB of shared
        # memory (an H100 has 227)
        return chosen | dict(BLOCK_K=2 * grouped_gemm.SPLIT_ACCUMULATION, num_stages=2)

    monkeypatch.setattr(grouped_gemm, "_tiles", deep)
    counts = [GROUP_ROWS, 2 * GROUP_ROWS]
    ends, rows = layout(counts)
    a = fp8_values((sum(counts), 640), torch.float8_e5m2, 7)  # 2.5 deep blocks: a masked edge
    b = fp8_values((2, 96, 640), torch.float8_e4m3fn, 8)
    scales = torch.tensor([0.5, 2.0])
    out = grouped_gemm.grouped_rows_gemm(
        a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), scales.to(DEVICE), ends.to(DEVICE),
        torch.float32, precise=True).cpu()
    for g, piece in enumerate(rows):
        want = (a[piece].double() @ b[g].double().t()) * (scales[g].double() ** 2)
        assert relative_error(out[piece], want) < FP32_BOUND


@pytest.mark.parametrize("group_m", [1, 3])
def test_rows_gemm_in_bands_of_row_blocks(monkeypatch, group_m):
    """The rows kernel's launch order (ROWS_GROUP_M): row-major (1) and bands of 3 row blocks,
    whose last band is shorter (8 row blocks of 32 under the interpreter, 4 of 128 on a GPU),
    write every block of the result once."""
    monkeypatch.setattr(grouped_gemm, "ROWS_GROUP_M", group_m)
    counts = ([GROUP_ROWS, 0, 2 * GROUP_ROWS, GROUP_ROWS] if DEVICE.type == "cuda"
              else [GROUP_ROWS, GROUP_ROWS])
    ends, rows = layout(counts)
    a = fp8_values((sum(counts), 64), torch.float8_e4m3fn, 11)
    b = fp8_values((len(counts), 160, 64), torch.float8_e4m3fn, 12)  # 5 column blocks of 32
    scales = torch.linspace(0.5, 2.0, len(counts))
    out = grouped_gemm.grouped_rows_gemm(
        a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), scales.to(DEVICE), ends.to(DEVICE),
        torch.float32, precise=False).cpu()
    for g, piece in enumerate(rows):
        if counts[g]:
            want = (a[piece].double() @ b[g].double().t()) * (scales[g].double() ** 2)
            assert relative_error(out[piece], want) < FP32_BOUND


@pytest.mark.parametrize("group_m", [1, 3])
def test_reduction_gemm_in_bands_of_row_blocks(monkeypatch, group_m):
    """The wgrad kernel's order within a group (REDUCTION_GROUP_M): row-major (1) and bands of
    3 row blocks with a shorter last band (5 row blocks of 32 under the interpreter, 2 of 128
    on a GPU) write every block of every group once."""
    monkeypatch.setattr(grouped_gemm, "REDUCTION_GROUP_M", group_m)
    counts = [GROUP_ROWS, 0, 2 * GROUP_ROWS]
    ends, rows = layout(counts)
    width_a = 160 if DEVICE.type != "cuda" else 256
    a = fp8_values((width_a, sum(counts)), torch.float8_e5m2, 15)
    b = fp8_values((96, sum(counts)), torch.float8_e4m3fn, 16)
    scales = torch.tensor([0.5, 1.0, 2.0])
    out = grouped_gemm.grouped_reduction_gemm(
        a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), scales.to(DEVICE), ends.to(DEVICE),
        torch.float32, precise=True).cpu()
    assert torch.equal(out[1], torch.zeros(width_a, 96))
    for g in (0, 2):
        want = (a[:, rows[g]].double() @ b[:, rows[g]].double().t()) * (scales[g].double() ** 2)
        assert relative_error(out[g], want) < FP32_BOUND


def test_reduction_gemm_refuses_blocks_deeper_than_a_group(monkeypatch):
    """The wgrad kernel steps through each group's rows BLOCK_K at a time: a block that does
    not divide GROUP_ROWS, such as one deeper than it, would read the next group's rows (an
    illegal address on an H100 when grouped_gemm_bench.py ran it with 256-deep blocks), so it
    says so instead of launching."""
    tiles = grouped_gemm._tiles
    monkeypatch.setattr(grouped_gemm, "_tiles", lambda device, stages, element_size=1: tiles(
        device, stages, element_size) | dict(BLOCK_K=2 * GROUP_ROWS))
    counts = [GROUP_ROWS, GROUP_ROWS]
    ends, _ = layout(counts)
    a = fp8_values((40, sum(counts)), torch.float8_e5m2, 9)
    b = fp8_values((72, sum(counts)), torch.float8_e4m3fn, 10)
    scales = torch.ones(2)
    with pytest.raises(ValueError, match="BLOCK_K 256 does not divide GROUP_ROWS"):
        grouped_gemm.grouped_reduction_gemm(
            a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), scales.to(DEVICE), ends.to(DEVICE),
            torch.bfloat16, precise=True)


def test_rows_gemm_refuses_blocks_that_straddle_groups(monkeypatch):
    """A BLOCK_M that does not divide GROUP_ROWS would give some blocks rows of two groups
    (the kernel looks up one group a block): an error, not a wrong product."""
    tiles = grouped_gemm._tiles
    monkeypatch.setattr(grouped_gemm, "_tiles", lambda device, stages, element_size=1: tiles(
        device, stages, element_size) | dict(BLOCK_M=96))
    counts = [GROUP_ROWS, GROUP_ROWS]
    ends, _ = layout(counts)
    a = fp8_values((sum(counts), 64), torch.float8_e4m3fn, 13)
    b = fp8_values((2, 32, 64), torch.float8_e4m3fn, 14)
    scales = torch.ones(2)
    with pytest.raises(ValueError, match="BLOCK_M 96 does not divide GROUP_ROWS"):
        grouped_gemm.grouped_rows_gemm(
            a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), scales.to(DEVICE), ends.to(DEVICE),
            torch.bfloat16, precise=False)


def test_fp16_operands_of_exact_values_for_the_nvfp4_experts():
    """The NVFP4 experts (modules/grouped_offsets_nvfp4.py) pass block values as fp16 (exact)
    with each group's global decode scales: both kernels take them (64-deep tiles on a GPU),
    fp32 output, one rounding of the scaled fp32 sum."""
    counts = [GROUP_ROWS, 0, 2 * GROUP_ROWS]
    ends, rows = layout(counts)
    g = torch.Generator().manual_seed(6)
    a = (torch.randn(sum(counts), 96, generator=g) * 4).half()
    b = (torch.randn(3, 80, 96, generator=g) * 4).half()
    a_scale, b_scale = torch.tensor([3e-3, 1.0, 7e-4]), torch.tensor([0.2, 1.0, 5e-2])
    out = grouped_gemm.grouped_rows_gemm(
        a.to(DEVICE), b.to(DEVICE), a_scale.to(DEVICE), b_scale.to(DEVICE), ends.to(DEVICE),
        torch.float32, precise=False).cpu()
    for group in (0, 2):
        want = (a[rows[group]].double() @ b[group].double().t()) * (
            a_scale[group].double() * b_scale[group])
        assert relative_error(out[rows[group]], want) < 1e-6
    a_t = (torch.randn(40, sum(counts), generator=g) * 4).half()
    b_t = (torch.randn(72, sum(counts), generator=g) * 4).half()
    out = grouped_gemm.grouped_reduction_gemm(
        a_t.to(DEVICE), b_t.to(DEVICE), a_scale.to(DEVICE), b_scale.to(DEVICE),
        ends.to(DEVICE), torch.float32, precise=False).cpu()
    assert torch.equal(out[1], torch.zeros(40, 72))
    for group in (0, 2):
        want = (a_t[:, rows[group]].double() @ b_t[:, rows[group]].double().t()) * (
            a_scale[group].double() * b_scale[group])
        assert relative_error(out[group], want) < 1e-6


def test_ops_take_the_kernels_and_agree_with_the_reference(monkeypatch):
    """The torch ops (modules/grouped_offsets.py) run these kernels here; forced onto the
    reference (torch._grouped_mm in fp32 on the CPU), they give the same values to rounding."""
    from minifloat.modules import grouped_offsets

    counts = [GROUP_ROWS, 3 * GROUP_ROWS]
    ends, _ = layout(counts)
    a = fp8_values((sum(counts), 64), torch.float8_e4m3fn, 6)
    b = fp8_values((2, 32, 64), torch.float8_e4m3fn, 7)
    scales = torch.tensor([0.5, 2.0])
    args = (a, b, scales, scales, ends)
    fast = grouped_offsets.grouped_rows_gemm(*[t.to(DEVICE) for t in args], torch.bfloat16,
                                             False).cpu()
    monkeypatch.setattr(grouped_offsets, "_kernel_serves", lambda _a: False)
    reference = grouped_offsets.grouped_rows_gemm(*args, torch.bfloat16, False)
    assert relative_error(fast, reference) < 2 * BF16_BOUND  # two roundings apart


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("depth", [96, 90])  # rows of whole words, and stored byte by byte
@pytest.mark.parametrize("products", [False, True])
def test_grouped_cast_writes_each_groups_reference_bytes(fp8_dtype, dtype, depth, products,
                                                         monkeypatch):
    """kernels/grouped_cast.py against numerics' cast_to_fp8 of each group's rows times that
    group's scale (an independent per-group computation), NaN of either sign, infinities and
    products that round into the subnormals or past the maximum included; the columnwise
    copy is the rowwise bytes transposed, also when it is the only copy asked for. `products`
    runs the GPU's algorithm under the interpreter too (per_tensor_fp8.EMULATE_PRODUCTS: a
    stand-in cvt that writes a wrong NaN byte, which only the tiles' NaN fix-up corrects)."""
    from minifloat.kernels import per_tensor_fp8
    from minifloat.numerics.formats import cast_to_fp8

    grouped_cast = pytest.importorskip("minifloat.kernels.grouped_cast")
    monkeypatch.setattr(per_tensor_fp8, "EMULATE_PRODUCTS", products)
    counts = [GROUP_ROWS, 0, 2 * GROUP_ROWS]
    ends, rows = layout(counts)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(sum(counts), depth, generator=g)
         * torch.exp2(torch.randint(-20, 12, (sum(counts), depth), generator=g).float()))
    x[3, 5], x[200, 7], x[300, 0], x[301, 1] = (float("nan"), -float("nan"), float("inf"),
                                                -float("inf"))
    x = x.to(dtype)
    scale = torch.tensor([3.0e-3, 7.0, 2.5e4])
    args = (x.to(DEVICE), scale.to(DEVICE), ends.to(DEVICE), fp8_dtype)
    data, data_t = grouped_cast.grouped_cast(*args, rowwise=True, columnwise=True)
    data, data_t = data.cpu().view(torch.uint8), data_t.cpu().view(torch.uint8)
    none, data_t_alone = grouped_cast.grouped_cast(*args, rowwise=False, columnwise=True)
    assert none is None and torch.equal(data_t_alone.cpu().view(torch.uint8), data_t)
    for group, piece in enumerate(rows):
        want = cast_to_fp8(x[piece].float() * scale[group], fp8_dtype).view(torch.uint8)
        wrong = (canonical_nan(data[piece], fp8_dtype) != canonical_nan(want, fp8_dtype))
        wrong = wrong.nonzero()
        assert wrong.numel() == 0, (f"group {group}: {len(wrong)} bytes differ, first at rows "
                                    f"{wrong[:4].tolist()} (x {x[piece][tuple(wrong[0])]})")
    assert torch.equal(data_t, data.t())


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("power_2_scale", [False, True])
@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-3])
def test_scales_of_many_amaxes_in_one_launch(fp8_dtype, power_2_scale, amax_epsilon):
    """kernels/amax.scales_from_amax over one amax per expert (the MoE group scales' op)
    against numerics.scale_from_amax and torch.reciprocal: ordinary maxima, 0, inf, NaN, one
    below the epsilon, tiny ones whose scale overflows to FLT_MAX (a subnormal reciprocal),
    FLT_MAX; a 0-d amax keeps its shape."""
    from minifloat.kernels import amax as amax_kernels
    from minifloat.numerics.formats import fp8_format
    from minifloat.numerics.per_tensor import scale_from_amax

    g = torch.Generator().manual_seed(9)
    amax = torch.cat([torch.rand(37, generator=g) * 1e3,
                      torch.tensor([0.0, float("inf"), float("nan"), 5e-4, 1e-40, 2e-45,
                                    torch.finfo(torch.float32).max])])
    scale, scale_inv = amax_kernels.scales_from_amax(amax.to(DEVICE), fp8_dtype == FP8[1],
                                                     amax_epsilon, power_2_scale)
    want = scale_from_amax(amax, fp8_format(fp8_dtype).max_value, amax_epsilon=amax_epsilon,
                           power_2_scale=power_2_scale)
    assert torch.equal(scale.cpu(), want)
    assert torch.equal(scale_inv.cpu(), torch.reciprocal(want))
    one, one_inv = amax_kernels.scales_from_amax(amax[3].to(DEVICE), False, amax_epsilon,
                                                 power_2_scale)
    assert one.shape == one_inv.shape == ()
