"""The one-launch current-scaling kernel (per_tensor_fp8._one_launch_kernel) on CUDA.

Its grid barrier cannot run under the interpreter (programs run one after another), so these
tests need a GPU. Each compares the one-launch bytes with the two-launch kernels' (amax
partials, then the cast), and with numerics.quantize_current_scaling on the CPU (the spec):
shapes whose tiles outnumber the programs (every program loops), back-to-back launches (the
barrier resets itself), two streams at once (one barrier each), NaN and inf inputs, and replay
inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the grid barrier cannot run under the interpreter",
                allow_module_level=True)
pytest.importorskip("triton")

from minifloat import numerics  # noqa: E402
from minifloat.kernels import per_tensor_fp8  # noqa: E402

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def two_launch(x, fp8_dtype, **options):
    saved = per_tensor_fp8.ONE_LAUNCH
    per_tensor_fp8.ONE_LAUNCH = False
    try:
        return per_tensor_fp8.quantize_current_scaling(x, fp8_dtype, **options)
    finally:
        per_tensor_fp8.ONE_LAUNCH = saved


def same_bytes(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()), what


def check(x, fp8_dtype=E4M3, reference=True, **options):
    one = per_tensor_fp8.quantize_current_scaling(x, fp8_dtype, **options)
    two = two_launch(x, fp8_dtype, **options)
    for a, b, what in zip(one, two, ("data", "transpose", "scale_inv"), strict=True):
        same_bytes(a, b, f"{what}: one launch != two launches, shape {tuple(x.shape)}")
    if reference:
        data, scale_inv = numerics.quantize_current_scaling(x.cpu(), fp8_dtype, **{
            k: v for k, v in options.items() if k in ("amax_epsilon", "power_2_scale")})
        k = x.shape[-1]
        if one[0] is not None:
            same_bytes(one[0], data.reshape(-1, k), "data != numerics")
        same_bytes(one[2], scale_inv.reshape(1), "scale_inv != numerics")
    return one


def sync_is_clear():
    pools = per_tensor_fp8._SYNC_POOLS.values()
    return all(int(pool[:, :3].abs().sum()) == 0 for pool in pools)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(16, 2048), (1, 1), (17, 130), (3, 1000, 1536),
                                   (8192, 2048), (2048, 8192)])
def test_matches_two_launches_and_numerics(shape, dtype):
    torch.manual_seed(sum(shape))
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    check(x, E4M3)
    check(x, E5M2, power_2_scale=True, columnwise=False)
    check(x, E4M3, amax_epsilon=1e4, rowwise=False, reference=False)
    assert sync_is_clear()


@pytest.mark.parametrize("special", ["nan", "inf", "zeros"])
def test_special_values(special):
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    if special == "zeros":
        x.zero_()
    else:
        x[100, 7] = float(special)
    check(x, E4M3)  # the NaN case: the same NaN bytes and scale_inv as both references
    check(x, E5M2, power_2_scale=True)
    assert sync_is_clear()


def test_back_to_back_launches_reset_the_barrier():
    torch.manual_seed(0)
    inputs = [torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * (i + 1)
              for i in range(20)]
    ones = [per_tensor_fp8.quantize_current_scaling(x, E4M3) for x in inputs]
    for x, one in zip(inputs, ones, strict=True):
        two = two_launch(x, E4M3)
        for a, b in zip(one, two, strict=True):
            same_bytes(a, b, "a later launch saw an earlier launch's barrier or amax")
    torch.cuda.synchronize()
    assert sync_is_clear()


def test_two_streams_at_once():
    torch.manual_seed(1)
    xs = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * s for s in (1, 100)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = [[], []]
    for _ in range(5):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[i].append(per_tensor_fp8.quantize_current_scaling(xs[i], E4M3))
    torch.cuda.synchronize()
    for i in range(2):
        expected = two_launch(xs[i], E4M3)
        for result in results[i]:
            for a, b in zip(result, expected, strict=True):
                same_bytes(a, b, "concurrent launches on two streams disturbed each other")


def test_cuda_graph_replay():
    torch.manual_seed(2)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    per_tensor_fp8.quantize_current_scaling(x, E4M3)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture's side stream
        per_tensor_fp8.quantize_current_scaling(x, E4M3)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = per_tensor_fp8.quantize_current_scaling(x, E4M3)
    for scale in (1.0, 7.0, 1e-3):
        x.copy_(torch.randn_like(x) * scale)
        graph.replay()
        torch.cuda.synchronize()
        expected = two_launch(x, E4M3)
        for a, b in zip(captured, expected, strict=True):
            same_bytes(a, b, "a replayed one-launch cast differs from an eager one")


def test_capture_before_any_pool_takes_two_launches(monkeypatch):
    """A capture must not allocate the barrier pool (the graph's private pool would reuse it):
    with no pool yet, the captured cast is the two-launch one, with the same bytes."""
    monkeypatch.setattr(per_tensor_fp8, "_SYNC_POOLS", {})
    monkeypatch.setattr(per_tensor_fp8, "_SYNC_SLOT", {})
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    two_launch(x, E4M3)  # compile the two-launch kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = per_tensor_fp8.quantize_current_scaling(x, E4M3)
    assert per_tensor_fp8._SYNC_POOLS == {}
    x.mul_(3)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, two_launch(x, E4M3), strict=True):
        same_bytes(a, b, "captured two-launch fallback")
