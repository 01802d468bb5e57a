"""The multi-tensor kernels' alignment hints change no bytes, and the host gives them only when
they hold for every tensor of the group.

The multi kernels read input offsets and shapes from a device table, so Triton cannot prove the
16-byte alignment and the divisibility of M, K that it proves for a single-tensor launch; the
host checks them and passes constexprs (multi_tensor._hints, nvfp4_multi X_ALIGNED /
OUT_ALIGNED / NARROW) that turn on `tl.multiple_of` hints. Here the inputs are views into one
shared buffer placed at offsets that are (or on purpose are not) multiples of 16 bytes, with M,
K multiples of 16 or odd; each tensor's outputs must equal, byte for byte, those of its own
single-tensor kernel call, and a spy on the launch records which hints were given.

Runs on CUDA (where the hints reach the compiled code), or on CPU tensors under
TRITON_INTERPRET=1 (hints are no-ops there: the host-side choice and the bytes are checked).
"""

from __future__ import annotations

import pytest
import torch

from minifloat import kernels

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip(
        "needs CUDA with Triton, or TRITON_INTERPRET=1 with Triton", allow_module_level=True
    )

from minifloat.kernels import (  # noqa: E402
    block_fp8,
    multi_tensor,
    nvfp4,
    nvfp4_multi,
    per_tensor_fp8,
)
from minifloat.kernels import launch as launch_module  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
]

E4M3 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16]
# name: (shapes, gap in elements after each tensor before rounding its successor's start up to
# `round_to` elements): round_to 16 keeps every offset a multiple of 16 elements (16 bytes for
# any input dtype), gap 1 with round_to 1 puts the second tensor on, e.g., a 2-byte boundary
LAYOUTS = {
    "aligned": ([(32, 48), (16, 128), (48, 16)], 0, 16),
    "unaligned_offsets": ([(32, 48), (16, 128), (48, 16)], 1, 1),
    "odd_shapes": ([(33, 17), (5, 130), (16, 7), (1, 1)], 0, 16),
    "odd_k": ([(32, 17), (48, 33)], 0, 16),
    "odd_m": ([(17, 32), (3, 48)], 0, 16),
}
EXPECTED_FP8_HINTS = {  # (input offsets aligned, M_ALIGNED, K_ALIGNED)
    "aligned": (True, True, True),
    "unaligned_offsets": (False, True, True),
    "odd_shapes": (True, False, False),
    "odd_k": (True, True, False),
    "odd_m": (True, False, True),
}


def _views(layout: str, dtype: torch.dtype, device: torch.device,
           seed: int = 0) -> list[torch.Tensor]:
    """Contiguous [M, K] views into one buffer, at the layout's offsets."""
    shapes, gap, round_to = LAYOUTS[layout]
    offsets, end = [], 0
    for m, k in shapes:
        start = -(-end // round_to) * round_to
        offsets.append(start)
        end = start + m * k + gap
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(end + 16, generator=gen)
    for i, (start, (m, k)) in enumerate(zip(offsets, shapes, strict=True)):
        flat[start:start + m * k] *= 2.0 ** (4 * i - 4)  # a different amax per tensor
    flat = flat.to(dtype).to(device)
    return [flat[start:start + m * k].view(m, k)
            for start, (m, k) in zip(offsets, shapes, strict=True)]


class _Spy:
    """Stands in for a kernel object: records the keyword arguments of each launch (the
    `spied` fixture turns kernels.launch's direct path off, which would skip the spy after the
    first launch of each specialisation)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return run


@pytest.fixture
def spied(monkeypatch):
    """Every launch through the kernel object (and so through a _Spy standing in for it)."""
    monkeypatch.setattr(launch_module, "_DIRECT", False)


def _same_bytes(actual, expected, what: str) -> None:
    assert (actual is None) == (expected is None), what
    if actual is None:
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a = actual.detach().cpu().contiguous().view(torch.uint8)
    b = expected.detach().cpu().contiguous().view(torch.uint8)
    assert torch.equal(a, b), what


def _fp8_hints_given(calls: list[dict], layout: str, dtype: torch.dtype) -> None:
    aligned, m_aligned, k_aligned = EXPECTED_FP8_HINTS[layout]
    divisor = 16 // torch.empty(0, dtype=dtype).element_size()
    for kwargs in calls:
        assert kwargs["X_DIVISOR"] == (divisor if aligned else 1), kwargs
        if "M_ALIGNED" in kwargs:
            assert (kwargs["M_ALIGNED"], kwargs["K_ALIGNED"]) == (m_aligned, k_aligned), kwargs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_block_1d_multi_bytes_equal_single(monkeypatch, spied, dtype, layout):
    xs = _views(layout, dtype, DEVICE)
    spy = _Spy(multi_tensor._multi_block_1d_kernel)
    monkeypatch.setattr(multi_tensor, "_multi_block_1d_kernel", spy)
    for usage in [(True, True), (True, False), (False, True)]:
        results = multi_tensor.quantize_block_1d_multi(xs, rowwise=usage[0],
                                                       columnwise=usage[1])
        for i, (x, result) in enumerate(zip(xs, results, strict=True)):
            single = block_fp8.quantize_block_1d(x, rowwise=usage[0], columnwise=usage[1])
            for name, got, want in zip(("row data", "row si", "col data", "col si"), result,
                                       single, strict=True):
                _same_bytes(got, want, f"{layout} tensor {i} {tuple(x.shape)} {usage} {name}")
                if got is not None:  # the scale grids column-major, as the single launch's
                    assert got.stride() == want.stride(), (name, got.stride(), want.stride())
    assert len(spy.calls) == 3
    _fp8_hints_given(spy.calls, layout, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_current_scaling_multi_bytes_equal_single(monkeypatch, spied, dtype, layout):
    xs = _views(layout, dtype, DEVICE, seed=1)
    spies = [_Spy(multi_tensor._multi_amax_kernel), _Spy(multi_tensor._multi_cast_kernel)]
    monkeypatch.setattr(multi_tensor, "_multi_amax_kernel", spies[0])
    monkeypatch.setattr(multi_tensor, "_multi_cast_kernel", spies[1])
    for usage in [(True, True), (False, True)]:
        results = multi_tensor.quantize_current_scaling_multi(
            xs, E4M3, rowwise=usage[0], columnwise=usage[1], power_2_scale=usage[0])
        for i, (x, result) in enumerate(zip(xs, results, strict=True)):
            single = per_tensor_fp8.quantize_current_scaling(
                x, E4M3, rowwise=usage[0], columnwise=usage[1], power_2_scale=usage[0])
            for name, got, want in zip(("data", "data_t", "scale_inv"), result, single,
                                       strict=True):
                _same_bytes(got, want, f"{layout} tensor {i} {tuple(x.shape)} {usage} {name}")
    assert len(spies[0].calls) == len(spies[1].calls) == 2
    _fp8_hints_given(spies[0].calls + spies[1].calls, layout, dtype)
    numel_aligned = all(x.numel() % 16 == 0 for x in xs)
    assert all(c["NUMEL_ALIGNED"] == numel_aligned for c in spies[0].calls)


@pytest.mark.parametrize("mode", [{}, {"with_rht": True}], ids=["1d", "rht"])
@pytest.mark.parametrize("layout", ["aligned", "unaligned_offsets"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_nvfp4_multi_bytes_equal_single(monkeypatch, spied, dtype, layout, mode):
    xs = _views(layout, dtype, DEVICE, seed=2)
    spies = [_Spy(nvfp4_multi._multi_amax_kernel), _Spy(nvfp4_multi._multi_1d_kernel)]
    monkeypatch.setattr(nvfp4_multi, "_multi_amax_kernel", spies[0])
    monkeypatch.setattr(nvfp4_multi, "_multi_1d_kernel", spies[1])
    kwargs = dict(rowwise=True, columnwise=True, **mode)
    outs = nvfp4_multi.quantize_nvfp4_multi(xs, **kwargs)
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        single = nvfp4.quantize_nvfp4(x, **kwargs)
        assert set(out) == set(single)
        for name in single:
            _same_bytes(out[name], single[name], f"{layout} tensor {i} {name}")
    for call in spies[0].calls + spies[1].calls:
        assert call["X_ALIGNED"] == (layout == "aligned"), call
        assert call["NARROW"], call
    assert all(call["OUT_ALIGNED"] for call in spies[1].calls)  # fresh allocations


def test_hints_hold_for_the_whole_group_or_are_not_given():
    shapes = [(32, 48), (16, 16)]
    assert multi_tensor._hints(shapes, [0, 1536], 2) == {
        "X_DIVISOR": 8, "M_ALIGNED": True, "K_ALIGNED": True}
    assert multi_tensor._hints(shapes, [0, 1540], 4)["X_DIVISOR"] == 4  # 16 bytes in fp32
    assert multi_tensor._hints(shapes, [0, 1540], 2)["X_DIVISOR"] == 1  # 8 bytes in bf16
    assert multi_tensor._hints(shapes, [-8, 0], 2)["X_DIVISOR"] == 8  # base may come later
    hints = multi_tensor._hints([*shapes, (0, 5)], [0, 1536, 0], 2)  # an empty tensor counts
    assert (hints["M_ALIGNED"], hints["K_ALIGNED"]) == (True, False)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_current_scaling_scale_inv_views_are_16_byte_aligned(layout):
    """cuBLAS's FP8 GEMM refuses a scale pointer that is not 16-byte aligned
    (CUBLAS_STATUS_NOT_SUPPORTED, seen with GroupedLinear's second expert): every tensor's
    scale_inv view from the multi-tensor launch starts on its own 16-byte slot."""
    tensors = _views(layout, torch.bfloat16, DEVICE)
    results = multi_tensor.quantize_current_scaling_multi(tensors, E4M3)
    for _, _, scale_inv in results:
        assert scale_inv.numel() == 1
        assert scale_inv.data_ptr() % 16 == 0
