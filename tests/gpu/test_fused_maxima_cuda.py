"""Current scaling's maxima under inductor on CUDA are the maxima of the stored tensor.

When a compiled graph fuses `x.abs().amax()` into the kernel that produces a bf16 x, inductor
takes it from the producer's fp32 values before their rounding to bf16 (an H200 showed per-tile
maxima of a fused activation gradient that differed from the stored tensor's). The scales then
do not come from the tensor the cast reads. input_recast.magnitude_bits takes the maxima over
x's integer view, which exists only after the rounding; and the scales come from an op, since
inductor's fp32 division and reciprocal need not be correctly rounded.
"""

import pytest
import torch

from minifloat.modules.grouped_offsets import GROUP_ROWS, group_scales
from minifloat.modules.input_recast import tensor_maximum
from minifloat.numerics.per_tensor import scale_from_amax

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def produce(h: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor from fp32 arithmetic (silu's backward shape) that inductor fuses."""
    s = torch.sigmoid(h.float())
    return (h.float() * s * (1 + h.float() * (1 - s)) * 1.37).to(torch.bfloat16)


def test_fused_group_maxima_are_the_stored_tensors():
    rows, depth, groups = 16 * GROUP_ROWS, 2048, 4
    h = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([4, 9, 12, 16], device="cuda", dtype=torch.int32) * GROUP_ROWS

    def fused(h):
        y = produce(h)
        return y, *group_scales(y, ends, torch.float8_e4m3fn, 0.0, False)

    y, scales, scale_invs = torch.compile(fused, fullgraph=True)(h)
    starts = [0, *ends.tolist()[:-1]]
    amax = torch.stack([y[s:e].abs().amax().float() for s, e in zip(starts, ends.tolist(),
                                                                     strict=True)])
    assert groups == len(starts)
    want = scale_from_amax(amax, 448.0)  # eager CUDA: correctly rounded division
    assert torch.equal(scales, want) and torch.equal(scale_invs, torch.reciprocal(want))


def test_fused_tensor_maximum_is_the_stored_tensors():
    h = torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16)

    def fused(h):
        y = produce(h)
        return y, tensor_maximum(y)

    y, amax = torch.compile(fused, fullgraph=True)(h)
    assert torch.equal(amax, y.abs().amax().float())
