"""The multi-tensor NVFP4 1D kernels give every tensor the bytes of its own quantization (the
numerics reference), with one amax reduction per kind for the whole group.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1; skipped otherwise.
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

from minifloat import numerics  # noqa: E402
from minifloat.kernels.nvfp4_multi import quantize_nvfp4_multi  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
]

SHAPES = [(16, 16), (48, 80), (2, 16, 32), (64, 128), (32, 16)]
MODES = {
    "1d": {},
    "rht": {"with_rht": True},
}


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for i, shape in enumerate(SHAPES):
        x = torch.randn(shape, generator=gen) * 2.0 ** (3 * i - 6)
        xs.append(x.to(dtype))
    xs[1].view(-1)[7] = 2.0e4  # one tensor with an outlier: its own global scale
    xs[3].view(-1)[:16] = 0.0
    return xs


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    assert actual.device.type == DEVICE.type, what
    a, b = actual.cpu(), expected.cpu()
    if a.element_size() == 1:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)],
                         ids=["both", "rowwise", "columnwise"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_multi_equals_reference_per_tensor(dtype, mode, usage):
    xs = _inputs(dtype)
    kwargs = dict(rowwise=usage[0], columnwise=usage[1], **MODES[mode])
    outs = quantize_nvfp4_multi([x.to(DEVICE) for x in xs], **kwargs)
    assert len(outs) == len(xs)
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        ref = numerics.quantize_nvfp4(x, **kwargs)
        assert set(out) == set(ref)
        for name in ref:
            _same(out[name], ref[name], f"tensor {i} {name}")


def test_multi_reduces_each_kind_of_amax_once_as_a_vector():
    xs = _inputs(torch.float32, seed=1)
    seen = []

    def reduce_amax(amax):
        seen.append(tuple(amax.shape))
        return amax * 2.0

    outs = quantize_nvfp4_multi(
        [x.to(DEVICE) for x in xs], rowwise=True, columnwise=True, with_rht=True,
        reduce_amax=reduce_amax,
    )
    assert seen == [(len(xs),), (len(xs),)]
    for x, out in zip(xs, outs, strict=True):
        ref = numerics.quantize_nvfp4(
            x, rowwise=True, columnwise=True, with_rht=True, reduce_amax=lambda a: a * 2.0
        )
        for name in ref:
            _same(out[name], ref[name], name)


def test_multi_stochastic_rounding_reproducible_and_per_tensor():
    base = torch.randn(32, 32, generator=torch.Generator().manual_seed(2))
    xs = [base.clone().to(DEVICE), base.clone().to(DEVICE)]  # equal tensors, separate streams
    runs = []
    for seed in (3, 3):
        torch.manual_seed(seed)
        runs.append(quantize_nvfp4_multi(xs, columnwise=True, stochastic_rounding=True))
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(runs[0][0][name].cpu(), runs[1][0][name].cpu()), name
        assert not torch.equal(runs[0][0][name].cpu(), runs[0][1][name].cpu()), name
    ref = numerics.quantize_nvfp4(base, rowwise=True, columnwise=True)
    for name in ("rowwise_scale", "columnwise_scale", "amax_rowwise"):
        _same(runs[0][1][name], ref[name], name)


def test_multi_rejects_mixed_groups_and_handles_empty():
    assert quantize_nvfp4_multi([]) == []
    with pytest.raises(ValueError, match="one device and dtype"):
        quantize_nvfp4_multi([
            torch.zeros(16, 16, device=DEVICE),
            torch.zeros(16, 16, device=DEVICE, dtype=torch.bfloat16),
        ])
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_nvfp4_multi([torch.zeros(16, 24, device=DEVICE)])
