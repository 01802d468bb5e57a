"""The nudged bf16 control: a measured noise floor for same-seed gaps (issue 19).

A recipe and the bf16 run of the same seed start from the same weights and read the same
batches, so their gap carries none of the seed-to-seed spread. It still carries chaos: training
amplifies any change of the trajectory, so even a recipe that costs nothing ends some distance
from its bf16 twin. How far is what the gap must be compared with, and only a run can say.

`bf16-nudged` is that run: the bf16 baseline in every way (no quantization, same seed, batches
and schedule) except that each initial weight is moved to the adjacent bfloat16 value, up or
down at random. That is the smallest change a bf16 model's weights can take, far smaller than
any recipe's rounding error, so its same-seed gap to bf16 is the part of every recipe's gap
that chaos alone produces. With `--seeds`, the summary takes the largest such gap over the
seeds as the noise floor of a paired gap (lab.seeds).

On the CPU the parameters are fp32: each weight is first rounded to bf16 and then nudged, the
same bf16 neighbour a CUDA run's bf16 weight moves to.
"""

from __future__ import annotations

import torch

CONTROL = "bf16-nudged"
# the nudges' directions come from their own stream, apart from the data (seed) and the
# validation batches (seed + 1)
_DIRECTION_STREAM = 7919


def nudge_weights(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter element to an adjacent bfloat16 value, up or down at random
    (a generator seeded from `seed`, so the same seed nudges the same way on any device)."""
    generator = torch.Generator().manual_seed(seed * 104729 + _DIRECTION_STREAM)
    with torch.no_grad():
        for parameter in model.parameters():
            # on the host: the directions and the rounding do not depend on the device
            value = parameter.detach().to("cpu", torch.bfloat16)
            up = torch.rand(value.shape, generator=generator) < 0.5
            toward = torch.where(up, torch.tensor(float("inf"), dtype=torch.bfloat16),
                                 torch.tensor(float("-inf"), dtype=torch.bfloat16))
            parameter.copy_(torch.nextafter(value, toward).to(parameter.device))
