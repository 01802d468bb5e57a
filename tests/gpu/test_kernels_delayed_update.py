"""The one-launch delayed-scaling update (kernels/delayed_update.py) against the reference.

numerics.delayed_scaling_update (followed by the copies RecipeState.update makes) is the
reference: history bytes and scale bytes must be identical, for both amax algorithms, margins,
history lengths of 1, 2, odd and longer than a row chunk, slot counts across the slot block,
amaxes of 0, subnormal, huge (fp8_max / amax overflowing to FLT_MAX), inf and NaN, and mixed
E4M3/E5M2 slots. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1; skipped otherwise.
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
from minifloat.kernels.delayed_update import (  # noqa: E402
    delayed_scaling_update_,
    delayed_scaling_update_many_,
)

pytestmark = pytest.mark.gpu

SPECIALS = [0.0, 1e-45, 1.2e-38, 3e38, float("inf"), float("nan"), 448.0, 1e-3]


def make_state(rows, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    history = torch.rand(rows, slots, generator=gen) * torch.pow(
        10.0, torch.randint(-6, 6, (rows, slots), generator=gen).float())
    # a few columns hold special values in their newest and oldest rows
    for column in range(min(slots, len(SPECIALS))):
        history[0, column] = SPECIALS[column]
        if rows > 1 and column % 2:
            history[-1, column] = SPECIALS[(column + 3) % len(SPECIALS)]
    if slots > len(SPECIALS):
        history[:, len(SPECIALS)] = 0.0  # an all-zero column keeps its scale
    scale = torch.rand(slots, generator=gen) * 4
    fp8_max = torch.tensor([448.0 if i % 3 else 57344.0 for i in range(slots)])
    return history.to(DEVICE), scale.to(DEVICE), fp8_max.to(DEVICE)


def bits(t):
    return t.contiguous().view(torch.int32).cpu()


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("rows,slots", [(1, 3), (2, 5), (7, 17), (300, 9), (1024, 40)])
def test_matches_reference_bitwise(algo, margin, rows, slots):
    history, scale, fp8_max = make_state(rows, slots, seed=rows * 100 + slots)
    expected_history, expected_scale = numerics.delayed_scaling_update(
        history.clone(), scale.clone(), fp8_max, margin=margin, amax_compute_algo=algo)
    delayed_scaling_update_(history, scale, fp8_max, margin=margin, amax_compute_algo=algo)
    assert torch.equal(bits(history), bits(expected_history.float()))
    assert torch.equal(bits(scale), bits(expected_scale.float()))


def test_repeated_updates_follow_the_reference():
    history, scale, fp8_max = make_state(16, 6, seed=5)
    ref_history, ref_scale = history.clone(), scale.clone()
    gen = torch.Generator().manual_seed(9)
    for _ in range(20):
        fresh = (torch.rand(6, generator=gen) * 10).to(DEVICE)
        history[0] = torch.maximum(history[0], fresh)
        ref_history[0] = torch.maximum(ref_history[0], fresh)
        delayed_scaling_update_(history, scale, fp8_max)
        new_history, new_scale = numerics.delayed_scaling_update(ref_history, ref_scale,
                                                                 fp8_max)
        ref_history.copy_(new_history)
        ref_scale.copy_(new_scale)
    assert torch.equal(bits(history), bits(ref_history))
    assert torch.equal(bits(scale), bits(ref_scale))


def test_bad_inputs_name_the_problem():
    history, scale, fp8_max = make_state(4, 3, seed=1)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        delayed_scaling_update_(history, scale, fp8_max, amax_compute_algo="mean")
    with pytest.raises(ValueError, match="scale must be"):
        delayed_scaling_update_(history, scale[:2], fp8_max)
    with pytest.raises(ValueError, match="amax_history must be"):
        delayed_scaling_update_(history.t(), scale, fp8_max)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("rows,slots", [(1, 3), (4, 17), (300, 9)])
def test_many_states_in_one_launch_follow_the_reference(algo, rows, slots):
    """Separate allocations (offsets from the first history, either sign), updated twice (the
    second update reuses the cached offset table)."""
    states = [make_state(rows, slots, seed=seed) for seed in range(5)]
    expected = [(h.clone(), s.clone(), m) for h, s, m in states]
    for _ in range(2):
        expected = [(*numerics.delayed_scaling_update(h, s, m, margin=1, amax_compute_algo=algo),
                     m) for h, s, m in expected]
        delayed_scaling_update_many_(states, margin=1, amax_compute_algo=algo)
        for (history, scale, _), (want_history, want_scale, _) in zip(states, expected,
                                                                        strict=True):
            assert torch.equal(bits(history), bits(want_history.float()))
            assert torch.equal(bits(scale), bits(want_scale.float()))


def test_many_states_refuse_what_would_race_or_mismatch():
    state = make_state(2, 3, seed=0)
    with pytest.raises(ValueError, match="appears twice"):
        delayed_scaling_update_many_([state, state])
    with pytest.raises(ValueError, match="one shape"):
        delayed_scaling_update_many_([state, make_state(3, 3, seed=1)])
