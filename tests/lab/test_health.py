"""The lab's curve health flags (issue 19): NaN, spikes and plateaus, named by run and step."""

from __future__ import annotations

import math

import torch

from minifloat.lab.health import loss_flags


def decaying(steps: int, seed: int = 0) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(steps, generator=generator) * 0.01
    return [3.0 * math.exp(-step / (steps / 3)) + 1.0 + float(noise[step])
            for step in range(steps)]


def test_a_healthy_run_has_no_flags():
    assert loss_flags("bf16", decaying(300)) == []


def test_nan_is_named_with_its_step():
    losses = decaying(100)
    losses[57] = math.nan
    flags = loss_flags("nvfp4", losses)
    assert any("nvfp4" in flag and "nan" in flag and "step 57" in flag for flag in flags)


def test_a_spike_is_named_with_its_step():
    losses = decaying(200)
    losses[120] *= 3
    (flag,) = loss_flags("fp8-current", losses)
    assert "spiked at step 120" in flag and "fp8-current" in flag


def test_a_plateau_is_named_with_the_step_it_began():
    """The small preset at lr 3e-3 in issue 19: down to ~2.3 by step 200, then flat."""
    generator = torch.Generator().manual_seed(1)
    losses = [5.0 - 2.7 * min(step, 200) / 200 + float(torch.randn(1, generator=generator))
              * 0.01 for step in range(1200)]
    (flag,) = loss_flags("bf16", losses)
    assert "stalled from step" in flag
    step = int(flag.split("stalled from step ")[1].split()[0])
    assert 180 <= step <= 260, flag


def test_a_slow_last_stretch_is_not_a_plateau():
    """Falling for 70% of the run, then flat under the cosine tail: healthy."""
    losses = [5.0 - 2.0 * min(step, 210) / 210 for step in range(300)]
    assert loss_flags("bf16", losses) == []


def test_short_runs_are_not_judged_for_plateaus():
    assert loss_flags("bf16", [2.0] * 20) == []
