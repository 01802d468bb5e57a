"""The multi-tensor MXFP8 kernel gives every tensor the bytes of its own single-tensor kernel
call and of the numerics reference, from one launch for the whole group.

Tensors of one call differ in shape, magnitude and hard cases (NaN, inf, zero and subnormal
blocks), so a tile that read or wrote another tensor's rows, or a block scale that leaked across
tensors, shows up as a byte difference. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1
(small shapes); skipped otherwise.
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
from minifloat.kernels import mxfp8_multi  # noqa: E402
from minifloat.kernels.mxfp8 import quantize_mxfp8  # noqa: E402
from minifloat.kernels.mxfp8_multi import quantize_mxfp8_multi  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    # the interpreter evaluates the scale arithmetic of NaN / inf / zero blocks through numpy
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ELEMS = {"e4m3": E4M3, "e5m2": E5M2}
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
USAGES = {"both": (True, True), "rowwise": (True, False), "columnwise": (False, True)}
FLT_MAX = torch.finfo(torch.float32).max
# uneven: K below, at and past the 128-wide tile, a 3-D tensor, an empty one
SHAPES = [(32, 32), (64, 160), (2, 16, 64), (0, 32), (96, 128), (32, 288)]


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Grid sizes of the kernel launches the module makes."""
    grids: list[int] = []
    original = mxfp8_multi.launch

    def spy(kernel, grid, *args, **kwargs):
        grids.append(grid[0])
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(mxfp8_multi, "launch", spy)
    return grids


def random_tensor(shape, seed, dtype=torch.float32, spread=10):
    """Normal values at a different power-of-two magnitude per row (many block scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    rows = x.reshape(-1, shape[-1]).shape[0]
    exponents = torch.randint(-spread, spread + 1, (rows, 1), generator=gen).float()
    return (x.reshape(rows, shape[-1]) * torch.exp2(exponents)).reshape(shape).to(dtype)


def adversarial(kind: str, shape=(64, 96)) -> torch.Tensor:
    """A float32 tensor with one hard case planted (M, K >= 64)."""
    x = random_tensor(shape, seed=len(kind), spread=3)
    if kind == "zeros":
        x.zero_()
    elif kind == "zero_blocks":
        x[0, :32] = 0.0
        x[:32, 1] = 0.0
    elif kind == "subnormal":
        x[3, :16] = torch.ldexp(torch.ones(16), torch.arange(-149, -133))
        x[5:, 1] = 2.0**-130
    elif kind == "tiny":
        x *= 1e-39  # fp32 subnormals everywhere: E8M0 exponents at 0
    elif kind == "huge":
        x[1, 5], x[9, 40] = 3.0e4, -6.0e4
    elif kind == "flt_max":
        x[2, 3], x[20, 7] = FLT_MAX, -FLT_MAX
    elif kind == "inf":
        x[2, 3], x[17, 33] = float("inf"), float("-inf")
    elif kind == "nan":
        x[4, 6] = float("nan")
    elif kind == "nan_block":
        x[32:64, 32:64] = float("nan")
    elif kind == "extreme_exponents":  # E8M0 0 and 254 (an infinite amax) next to each other
        x[0:32, 0:32] = torch.ones(32, 32) * 2.0**-135
        x[0:32, 32:64] = torch.randn(32, 32) * 2.0**127
        x[32:64, 32:64] = torch.randn(32, 32) * 2.0**100
        x[40, 40] = float("inf")
    elif kind == "fp8_ties":  # halfway between E4M3 (row 0) / E5M2 (row 1) neighbours, scale 1
        x[0, :10] = torch.tensor([448.0, 1.0625, 1.1875, 2.125, 2.375, 272.0, -1.0625,
                                  0.0126953125, 0.0029296875, 2.0**-10])
        x[1, :8] = torch.tensor([57344.0, 1.125, 1.375, 2.25, 40960.0, -1.125, 2.0**-17, 0.5])
        x[2, 0], x[3, 0] = 464.0, 61440.0
    return x


ADVERSARIAL = ["zeros", "zero_blocks", "subnormal", "tiny", "huge", "flt_max", "inf", "nan",
               "nan_block", "extreme_exponents", "fp8_ties"]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_matches_single_and_reference(xs, outs, elem, rowwise, columnwise) -> None:
    """outs[i] has the keys, shapes, dtypes and bytes of quantize_mxfp8(xs[i]) (the kernel) and
    of numerics.quantize_mxfp8(xs[i]) (the reference, on CPU)."""
    assert len(outs) == len(xs)
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        kwargs = dict(rowwise=rowwise, columnwise=columnwise, dtype=elem)
        single = quantize_mxfp8(x, **kwargs)
        reference = numerics.quantize_mxfp8(x.cpu(), **kwargs)
        assert list(out) == list(single) == list(reference), f"tensor {i}"
        for name, ref in reference.items():
            what = f"tensor {i} {tuple(x.shape)} {name}"
            got = out[name]
            assert got.shape == ref.shape == single[name].shape, what
            assert got.dtype == ref.dtype == single[name].dtype, what
            assert got.device == x.device and got.is_contiguous(), what
            a, s, r = _raw(got), _raw(single[name]), _raw(ref)
            assert torch.equal(a, s), f"{what}: differs from the single-tensor kernel"
            bad = (a != r).nonzero()
            assert bad.numel() == 0, (
                f"{what}: {bad.shape[0]} of {r.numel()} bytes differ from the reference, first "
                f"at {bad[0].tolist()}"
            )


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("elem", list(ELEMS))
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_uneven_tensors_random(dtype, elem, usage, launches):
    xs = [random_tensor(shape, seed=i, dtype=dtype).to(DEVICE) for i, shape in enumerate(SHAPES)]
    rowwise, columnwise = USAGES[usage]
    outs = quantize_mxfp8_multi(xs, dtype=ELEMS[elem], rowwise=rowwise, columnwise=columnwise)
    assert launches == [1 + 4 + 1 + 0 + 3 + 3], "one launch: one program per tile"
    assert_matches_single_and_reference(xs, outs, ELEMS[elem], rowwise, columnwise)


@pytest.mark.parametrize("elem", list(ELEMS))
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=str)
def test_adversarial_blocks_stay_in_their_tensor(dtype, elem, launches):
    """Every hard case in its own tensor of one call, between ordinary tensors."""
    xs = []
    for i, kind in enumerate(ADVERSARIAL):
        xs.append(adversarial(kind).to(dtype).to(DEVICE))
        if i % 3 == 0:
            xs.append(random_tensor((32, 64), seed=i, dtype=dtype).to(DEVICE))
    for usage in USAGES.values():
        outs = quantize_mxfp8_multi(xs, dtype=ELEMS[elem], rowwise=usage[0],
                                    columnwise=usage[1])
        assert_matches_single_and_reference(xs, outs, ELEMS[elem], *usage)
    assert len(launches) == len(USAGES)


def test_one_tensor(launches):
    x = random_tensor((64, 96), seed=5, dtype=torch.bfloat16).to(DEVICE)
    outs = quantize_mxfp8_multi([x])
    assert launches == [2]
    assert_matches_single_and_reference([x], outs, E4M3, True, True)


@pytest.mark.parametrize("elem", list(ELEMS))
def test_forty_tensors_one_launch(elem, launches):
    """Forty experts: separate allocations and row splits of one tensor, empty ones included."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(32 * int(torch.randint(0, 4, (1,), generator=gen)), 32 * (1 + i % 3))
              for i in range(24)]
    xs = [random_tensor(shape, seed=i, dtype=torch.bfloat16).to(DEVICE)
          for i, shape in enumerate(shapes)]
    splits = [32 * (i % 3) for i in range(16)]
    whole = random_tensor((sum(splits), 64), seed=99, dtype=torch.bfloat16).to(DEVICE)
    xs += list(torch.split(whole, splits))
    outs = quantize_mxfp8_multi(xs, dtype=ELEMS[elem])
    tiles = [(m // 32) * -(-k // 128) for m, k in shapes] + [rows // 32 for rows in splits]
    assert launches == [sum(tiles)]
    assert_matches_single_and_reference(xs, outs, ELEMS[elem], True, True)


def test_unaligned_inputs():
    """Inputs that start off 16-byte boundaries (views into a flat buffer) take unhinted
    loads; the bytes are the same."""
    flat = random_tensor((4 * 1024 + 64,), seed=3).to(DEVICE)
    xs = [flat[3:3 + 1024].view(32, 32), flat[1100:1100 + 2048].view(32, 64),
          flat[64:64 + 1024].view(32, 32)]
    outs = quantize_mxfp8_multi(xs)
    assert_matches_single_and_reference(xs, outs, E4M3, True, True)


def test_outputs_are_separate_per_tensor():
    """Each tensor's buffers are its own region: writing one leaves the others alone."""
    xs = [random_tensor((32, 64), seed=s).to(DEVICE) for s in range(3)]
    outs = quantize_mxfp8_multi(xs)
    before = [_raw(out["rowwise_data"]).clone() for out in outs]
    outs[1]["rowwise_data"].view(torch.uint8).fill_(0)
    outs[1]["columnwise_scale"].fill_(0)
    assert torch.equal(_raw(outs[0]["rowwise_data"]), before[0])
    assert torch.equal(_raw(outs[2]["rowwise_data"]), before[2])


def test_empty_inputs_and_no_usage(launches):
    assert quantize_mxfp8_multi([]) == []
    xs = [torch.zeros(32, 32, device=DEVICE), torch.zeros(0, 64, device=DEVICE)]
    assert quantize_mxfp8_multi(xs, rowwise=False, columnwise=False) == [{}, {}]
    outs = quantize_mxfp8_multi([torch.zeros(0, 64, device=DEVICE)])
    assert launches == [], "nothing to quantize: no launch"
    assert outs[0]["rowwise_data"].shape == (0, 64)
    assert outs[0]["columnwise_scale"].shape == (0, 64)


def test_rejects_what_the_single_kernel_rejects(launches):
    good = torch.zeros(32, 32, device=DEVICE)
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_mxfp8_multi([good, torch.zeros(48, 32, device=DEVICE)])
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_mxfp8_multi([good, torch.zeros(32, 48, device=DEVICE)])
    with pytest.raises(ValueError, match="contiguous"):
        quantize_mxfp8_multi([good, torch.zeros(64, 32, device=DEVICE).t()])
    with pytest.raises(ValueError, match="one device and dtype"):
        quantize_mxfp8_multi([good, good.to(torch.bfloat16)])
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        quantize_mxfp8_multi([good.double()])
    assert launches == []


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host syncs exist on CUDA only")
def test_no_host_synchronisation():
    xs = [random_tensor((32, 64), seed=s, dtype=torch.bfloat16).to(DEVICE) for s in range(4)]
    quantize_mxfp8_multi(xs)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quantize_mxfp8_multi(xs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
