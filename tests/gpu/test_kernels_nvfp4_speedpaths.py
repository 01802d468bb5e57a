"""The fast NVFP4 kernel paths against the numerics reference, on inputs aimed at what they change.

Why a separate file: the kernels now (1) read the columnwise copy as 16 row slices, so the RHT
butterflies and run amaxes are elementwise across slices and nibbles are packed into words,
(2) round E2M1 through a min of three fp32 "magic" adds instead of compares, with NaN blocks
zeroed per packed word, (3) draw 16 random bits per stochastic decision (a dither), and
(4) choose launch tiles per kind. Each of those has edge cases that the general tests hit only by
chance: tiles cut by the tensor edge, R = 1 slices, signed zeros from exact cancellation in the
butterflies, overflow to inf and inf - inf inside a run, E2M1 ties at every piece boundary, and
grid values under stochastic rounding. RNE paths must match byte for byte; SR statistically.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (small shapes); skipped otherwise.
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
from minifloat.kernels import nvfp4 as nvfp4_kernels  # noqa: E402
from minifloat.kernels.nvfp4_multi import quantize_nvfp4_multi  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

CUDA = DEVICE.type == "cuda"
MODES = {"1d": {}, "rht": {"with_rht": True}, "2d": {"two_dimensional": True}}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = torch.finfo(torch.float32).max
# M, K multiples of 16 but not of the tiles (the edge tiles are partly outside the tensor)
ODD_SHAPES = [(16, 272), (208, 48), (80, 144), (2, 48, 176)]
if CUDA:
    ODD_SHAPES += [(528, 1040), (1040, 528), (16, 4112)]


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same(out: dict, ref: dict, label: str = "") -> None:
    assert set(out) == set(ref), label
    for name, expected in ref.items():
        a, b = _raw(out[name]), _raw(expected)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{label}{name}"
        if a.dtype == torch.uint8:
            bad = (a != b).nonzero()
            if bad.numel():
                first = tuple(bad[0].tolist())
                raise AssertionError(
                    f"{label}{name}: {bad.shape[0]} of {b.numel()} bytes differ, first at "
                    f"{list(first)}: {a[first].item():#04x} instead of {b[first].item():#04x}"
                )
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"{label}{name}")


def _both(x: torch.Tensor, rowwise=True, columnwise=True, **options):
    kwargs = dict(rowwise=rowwise, columnwise=columnwise, **options)
    out = nvfp4_kernels.quantize_nvfp4(x.to(DEVICE), **kwargs)
    return out, numerics.quantize_nvfp4(x, **kwargs)


def _spread(shape, seed, dtype=torch.float32, spread=6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    rows = x.reshape(-1, shape[-1])
    rows *= torch.exp2(torch.randint(-spread, spread + 1, (rows.shape[0], 1), generator=gen))
    return x.to(dtype)


# --------------------------------------------------------------------------------------------
# tiles cut by the tensor edge, every mode, dtype and direction
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("usage", [(True, True), (False, True), (True, False)],
                         ids=["both", "columnwise", "rowwise"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_shapes_match_reference(shape, mode, usage):
    for dtype in DTYPES:
        x = _spread(shape, seed=sum(shape), dtype=dtype)
        out, ref = _both(x, *usage, **MODES[mode])
        _assert_same(out, ref, f"{shape}/{dtype}/{mode}.")


@pytest.mark.parametrize("tile", [(16, 32, 1, 1), (32, 64, 2, 2), (16, 128, 4, 2)], ids=str)
def test_other_launch_tiles_give_the_same_bytes(monkeypatch, tile):
    """The bytes must not depend on the launch shape (R = 1 slices included), and neither may
    stochastic rounding's draws: they are keyed by element offsets, not by tile."""
    block_m, block_k, warps, warps_2d = tile
    x = _spread((48, 96), seed=3, dtype=torch.bfloat16)
    torch.manual_seed(4)
    sr_before = nvfp4_kernels.quantize_nvfp4(
        x.to(DEVICE), columnwise=True, stochastic_rounding=True, with_rht=True)
    for name, value in (("BLOCK_M", block_m), ("BLOCK_K", block_k), ("NUM_WARPS", warps),
                        ("AMAX_NUM_WARPS", warps), ("NUM_WARPS_STOCHASTIC", warps),
                        ("BLOCK_M_2D", block_m), ("BLOCK_K_2D", block_k),
                        ("NUM_WARPS_2D", warps_2d)):
        monkeypatch.setattr(nvfp4_kernels, name, value)
    for mode in MODES:
        out, ref = _both(x, **MODES[mode])
        _assert_same(out, ref, f"{tile}/{mode}.")
    torch.manual_seed(4)
    sr_after = nvfp4_kernels.quantize_nvfp4(
        x.to(DEVICE), columnwise=True, stochastic_rounding=True, with_rht=True)
    _assert_same(sr_after, sr_before, f"{tile}/sr.")


def test_multi_tensor_odd_shapes_with_rht():
    xs = [_spread(shape, seed=i, dtype=torch.bfloat16) for i, shape in enumerate(ODD_SHAPES)]
    outs = quantize_nvfp4_multi([x.to(DEVICE) for x in xs], columnwise=True, with_rht=True)
    for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
        ref = numerics.quantize_nvfp4(x, rowwise=True, columnwise=True, with_rht=True)
        _assert_same(out, ref, f"tensor {i}.")


# --------------------------------------------------------------------------------------------
# the RHT on slices: signed zeros, overflow, inf - inf, NaN
# --------------------------------------------------------------------------------------------


def _rht_hard_runs(dtype):
    """[64, 48]: each column is three runs of 16 along M built to stress the butterflies."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 48, generator=gen)
    signs = torch.where(torch.rand(64, 48, generator=gen) < 0.5, -1.0, 1.0)
    x[:16, 0:8] = 0.0 * signs[:16, 0:8]  # runs of +-0 only: every result a signed zero
    x[16:32, 0:8] = torch.where(signs[16:32, 0:8] > 0, 1.5, -1.5)  # +-a: exact cancellations
    x[32:48, 0:4] = torch.where(torch.arange(16)[:, None] % 2 == 0, 2.0, -2.0)
    x[:16, 8:10] = FLT_MAX * signs[:16, 8:10]  # sums overflow to +-inf, then inf - inf = NaN
    x[16, 10] = float("inf")
    x[33, 11], x[40, 11] = float("inf"), float("-inf")
    x[50, 12] = float("nan")
    x[:16, 13] = 2.0**-140 * signs[:16, 13]  # fp32 subnormals through the butterflies
    x[16:32, 14] = torch.ldexp(torch.ones(16), torch.arange(-149, -133)) * signs[16:32, 14]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rht_hard_runs_match_reference(dtype):
    x = _rht_hard_runs(dtype)
    for usage in ((True, True), (False, True)):
        out, ref = _both(x, *usage, with_rht=True)
        _assert_same(out, ref, f"{dtype}/{usage}.")
    # without the inf/NaN columns the global amax is finite: the signed zeros are visible
    finite = x.clone()
    finite[:, 8:13] = 1.0
    out, ref = _both(finite, with_rht=True)
    _assert_same(out, ref, f"{dtype}/finite.")


def test_rht_signed_zero_runs_keep_their_signs():
    """All-zero input with mixed signs: every RHT output is a signed zero, and the nibbles
    carry those signs (Triton's unary minus, 0 - x, would turn -0 into +0)."""
    signs = torch.where(torch.rand(32, 32, generator=torch.Generator().manual_seed(5)) < 0.5,
                        -1.0, 1.0)
    x = 0.0 * signs
    out, ref = _both(x, with_rht=True)
    _assert_same(out, ref)
    assert (_raw(ref["columnwise_data"]) != 0).any(), "the reference should hold -0 nibbles"


# --------------------------------------------------------------------------------------------
# E2M1 rounding at every piece boundary (element scale 1: global amax 2688, block amax 6)
# --------------------------------------------------------------------------------------------

BOUNDARIES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]


def _boundary_values() -> torch.Tensor:
    points = torch.tensor(BOUNDARIES)
    up = torch.nextafter(points, torch.full_like(points, 7.0))
    down = torch.nextafter(points, torch.zeros_like(points))
    values = torch.cat((points, up, down, torch.tensor([2.0**-149, 2.0**-126, 0.2499, 5.999])))
    return values.clamp(max=6.0)


def _boundary_tensor(two_d: bool) -> torch.Tensor:
    """Rows of 16 (1D) or 16x16 tiles (2D) whose amax is exactly 6, holding the boundary values
    with both signs, plus one 2688 for the global amax."""
    values = _boundary_values()
    values = torch.cat((values, -values))
    count = values.numel()
    cols = 64
    rows = 16 * ((count + 15 * (cols // 16) - 1) // (15 * (cols // 16)) + 1)
    x = torch.zeros(rows, cols)
    free = torch.ones(rows, cols, dtype=torch.bool)
    if two_d:
        x[::16, ::16] = 6.0
        free[::16, ::16] = False
    else:
        x[:, ::16] = 6.0
        free[:, ::16] = False
    slots = free.nonzero()[:count]
    x[slots[:, 0], slots[:, 1]] = values
    x[0, 0] = 2688.0
    return x


@pytest.mark.parametrize("mode", ["1d", "2d"])
def test_e2m1_piece_boundaries_and_ties(mode):
    x = _boundary_tensor(mode == "2d")
    for source in (x, x.t().contiguous()):  # rowwise and columnwise see every value
        out, ref = _both(source, **MODES[mode])
        _assert_same(out, ref, f"{mode}.")


# --------------------------------------------------------------------------------------------
# stochastic rounding with 16-bit dithers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["1d", "2d"])
def test_sr_leaves_grid_values_alone(mode):
    """Values on the E2M1 grid (element scale 1) never move: SR bytes equal RNE bytes."""
    grid = torch.tensor(numerics.formats.E2M1_VALUES).clamp(min=-6.0, max=6.0)
    gen = torch.Generator().manual_seed(8)
    x = grid[torch.randint(0, grid.numel(), (64, 64), generator=gen)]
    x[:, ::16] = 6.0  # every block along K ...
    x[::16, :] = 6.0  # ... and along M has amax 6: element scale 1
    x[:16, :16] = 0.0  # one tile of zeros around the global amax (its own scale)
    x[0, 0] = 2688.0
    options = {"two_dimensional": True} if mode == "2d" else {}
    torch.manual_seed(9)
    sr = nvfp4_kernels.quantize_nvfp4(x.to(DEVICE), columnwise=True, stochastic_rounding=True,
                                      **options)
    rne = nvfp4_kernels.quantize_nvfp4(x.to(DEVICE), columnwise=True, **options)
    _assert_same(sr, rne, f"{mode}.")


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_sr_up_probability_matches_fraction(direction):
    """A value a third of the way from 1 to 1.5 rounds up a third of the time (16-bit dithers
    resolve probabilities to 2^-16, far below this test's tolerance), in both directions."""
    rows, cols = (512, 256) if CUDA else (64, 128)
    x = torch.full((rows, cols), 1.0 + 0.5 / 3.0)
    x[:, ::16] = 6.0  # block amax 6 along K ...
    x[::16, :] = 6.0  # ... and along M: element scale 1 in both directions
    x[0, 0] = 2688.0
    torch.manual_seed(10)
    out = nvfp4_kernels.quantize_nvfp4(x.to(DEVICE), columnwise=True, stochastic_rounding=True)
    values = numerics.e2m1_to_float(out[f"{direction}_data"].cpu())
    source = x if direction == "rowwise" else x.t()
    inner = values[source == 1.0 + 0.5 / 3.0]
    assert set(inner.unique().tolist()) <= {1.0, 1.5}
    up = (inner == 1.5).double().mean().item()
    sigma = (1 / 3 * 2 / 3 / inner.numel()) ** 0.5
    assert abs(up - 1 / 3) < 6 * sigma, (up, inner.numel())


@pytest.mark.parametrize("shape", [(48, 80), (16, 272)], ids=str)
@pytest.mark.parametrize("mode", ["1d", "rht", "2d"])
def test_sr_odd_shapes_are_neighbours_with_exact_scales(shape, mode):
    x = _spread(shape, seed=12, dtype=torch.bfloat16)
    options = MODES[mode]
    torch.manual_seed(13)
    out = nvfp4_kernels.quantize_nvfp4(x.to(DEVICE), columnwise=True, stochastic_rounding=True,
                                       **options)
    ref = numerics.quantize_nvfp4(x, columnwise=True, **options)
    for name in ("rowwise_scale", "columnwise_scale", "amax_rowwise", "amax_columnwise"):
        _assert_same({name: out[name]}, {name: ref[name]})
    grid = torch.tensor(numerics.formats.E2M1_VALUES)
    x_t = x.t()
    if options.get("with_rht"):
        x_t = numerics.random_hadamard_transform(x_t)
    for direction, source in (("rowwise", x), ("columnwise", x_t)):
        s_dec = numerics.global_decode_scale(out[f"amax_{direction}"].cpu().reshape(()))
        scale = out[f"{direction}_scale"].cpu().float()
        element_scale = torch.clamp(torch.reciprocal(scale * s_dec), max=FLT_MAX)
        scaled = (source.float() * element_scale.repeat_interleave(16, dim=1)).clamp(-6, 6)
        values = numerics.e2m1_to_float(out[f"{direction}_data"].cpu())
        rne = numerics.e2m1_to_float(ref[f"{direction}_data"])
        lower = grid[(grid[None, :] <= scaled.abs().reshape(-1, 1)).sum(1) - 1]
        upper = grid[torch.clamp(8 - (grid[None, :] >= scaled.abs().reshape(-1, 1)).sum(1),
                                 max=7)]
        magnitude = values.abs().reshape(-1)
        ok = (magnitude == lower) | (magnitude == upper)
        assert ok.all(), f"{direction}: {(~ok).sum().item()} results are not neighbours"
        assert not torch.equal(values, rne), direction


# --------------------------------------------------------------------------------------------
# 16x16 (2D) words kernel (kernels/nvfp4_words.py): int64 words in, nibble words out
# --------------------------------------------------------------------------------------------

WORDS_TILES = [(16, 64, 1), (16, 256, 1), (16, 512, 2), (32, 128, 2), (64, 64, 2)]


def _words_2d(monkeypatch, tile=None) -> list:
    """Route 2D bf16 quantization through the words kernel (with `tile`) and record its calls
    (the launch function as nvfp4.quantize_nvfp4 calls it)."""
    monkeypatch.setattr(nvfp4_kernels, "WORDS_2D", True)
    if tile is not None:
        for name, value in zip(("WORDS_BLOCK_M_2D", "WORDS_BLOCK_K_2D", "WORDS_NUM_WARPS_2D"),
                               tile, strict=True):
            monkeypatch.setattr(nvfp4_kernels, name, value)
    calls = []
    launch = nvfp4_kernels.launch_2d_words

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return launch(*args, **kwargs)

    monkeypatch.setattr(nvfp4_kernels, "launch_2d_words", spy)
    return calls


def _hard_2d_tiles() -> torch.Tensor:
    """[64, 96] bf16 whose 16x16 tiles are each a special case: NaN of both signs, +-inf, huge
    (FLT_MAX, bf16 max), subnormal-only, all +-0, and mixed signs around the E2M1 ties."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(64, 96, generator=gen) * 3.0
    signs = torch.where(torch.rand(64, 96, generator=gen) < 0.5, -1.0, 1.0)
    x[0:16, 0:16] = 0.0 * signs[0:16, 0:16]  # signed zeros only
    x[0:16, 16:32] *= 2.0**-130  # bf16 subnormals only (amax subnormal too)
    x[3, 40] = float("nan")
    x[20, 5] = -float("nan")
    x[17, 50] = float("inf")
    x[30, 70] = -float("inf")
    x[40:56, 0:16] = FLT_MAX * signs[40:56, 0:16]
    x[40:56, 16:32] = torch.finfo(torch.bfloat16).max * signs[40:56, 16:32]
    x[56:64, 32:48] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(8, 2)
    x[48, 32] = 6.0
    x[56:64, 48:64] = -x[56:64, 32:48]
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("tile", WORDS_TILES, ids=str)
def test_2d_words_kernel_matches_reference(monkeypatch, tile):
    """Tiles cut by the tensor edge in both dimensions (masked runs and pairs)."""
    calls = _words_2d(monkeypatch, tile)
    shapes = [(16, 272), (208, 48), (2, 48, 176)] + ([(528, 1040), (1040, 528)] if CUDA else [])
    for shape in shapes:
        x = _spread(shape, seed=sum(shape), dtype=torch.bfloat16, spread=20)
        out, ref = _both(x, two_dimensional=True)
        _assert_same(out, ref, f"{shape}/{tile}.")
    assert len(calls) == len(shapes)


@pytest.mark.parametrize("usage", [(False, True), (True, False)], ids=["columnwise", "rowwise"])
def test_2d_words_kernel_single_direction(monkeypatch, usage):
    calls = _words_2d(monkeypatch, (32, 128, 2))
    x = _spread((80, 144), seed=7, dtype=torch.bfloat16, spread=20)
    out, ref = _both(x, *usage, two_dimensional=True)
    _assert_same(out, ref, f"{usage}.")
    assert len(calls) == 1


@pytest.mark.parametrize("usage", [(True, True), (False, True), (True, False)],
                         ids=["both", "columnwise", "rowwise"])
def test_2d_words_kernel_special_tiles(monkeypatch, usage):
    calls = _words_2d(monkeypatch, (16, 64, 1))
    x = _hard_2d_tiles()
    out, ref = _both(x, *usage, two_dimensional=True)
    _assert_same(out, ref, "nan.")
    finite = torch.nan_to_num(x.float(), nan=1.0, posinf=2.0, neginf=-2.0)
    finite[40:56, 0:16] = 1.0
    for source in (finite, finite.t().contiguous(), torch.zeros(32, 48),
                   torch.full((16, 16), -0.0)):
        out, ref = _both(source.to(torch.bfloat16), *usage, two_dimensional=True)
        _assert_same(out, ref, "finite.")
    assert len(calls) == 5


def test_2d_words_kernel_e2m1_boundaries(monkeypatch):
    """Every piece boundary and tie of the E2M1 rule (element scale 1), both directions."""
    calls = _words_2d(monkeypatch, (32, 128, 2))
    x = _boundary_tensor(True).to(torch.bfloat16)
    for source in (x, x.t().contiguous()):
        out, ref = _both(source, two_dimensional=True)
        _assert_same(out, ref, "boundaries.")
    assert len(calls) == 2


def test_2d_words_kernel_only_serves_bf16_round_to_nearest(monkeypatch):
    calls = _words_2d(monkeypatch)
    x = _spread((32, 64), seed=5)
    for dtype in (torch.float32, torch.float16):
        out, ref = _both(x.to(dtype), two_dimensional=True)
        _assert_same(out, ref, f"{dtype}.")
    nvfp4_kernels.quantize_nvfp4(x.bfloat16().to(DEVICE), columnwise=True,
                                 two_dimensional=True, stochastic_rounding=True)
    assert not calls
    monkeypatch.setattr(nvfp4_kernels, "WORDS_2D", False)
    out, ref = _both(x.bfloat16(), two_dimensional=True)
    _assert_same(out, ref, "flag off.")
    assert not calls
