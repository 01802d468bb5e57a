"""make_graphed_step on a GPU: a captured training step replays the eager step bit for bit, and
what it cannot replay is refused (minifloat/step_graphs.py). Under FSDP2:
test_distributed_nccl_single.test_a_graphed_fsdp2_step_trains_like_eager_bitwise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minifloat as mf
from train_steps import loss_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HIDDEN, ROWS = 256, 64


def _setup(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(mf.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"),
                          mf.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)
    return model, loss_step(model, optimizer, recipe)


def _inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(3)
    return [torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(count)]


@pytest.mark.parametrize("recipe", [mf.Float8CurrentScaling, mf.MXFP8BlockScaling,
                                    mf.NVFP4BlockScaling], ids=["current", "mxfp8", "nvfp4"])
def test_replays_equal_eager_steps_bitwise(recipe):
    """NVFP4 with its default stochastic rounding: the seeds come from torch's generator, which
    capture advances at each replay as eager draws advance it."""
    results = {}
    for graphed in (False, True):
        model, step = _setup(recipe())
        run = mf.make_graphed_step(step) if graphed else step
        torch.manual_seed(5)
        losses = [run(x).clone() for x in _inputs(6)]
        results[graphed] = losses + [p.detach().clone() for p in model.parameters()]
    for index, (a, b) in enumerate(zip(results[True], results[False], strict=True)):
        assert torch.equal(a, b), f"result {index}"


def test_another_shape_is_refused():
    _, step = _setup(mf.Float8CurrentScaling())
    run = mf.make_graphed_step(step, num_warmup_iters=1)
    x = _inputs(1)[0]
    run(x)
    run(x)  # captured
    with pytest.raises(ValueError, match="replays the arguments it was captured with"):
        run(x[: ROWS // 2])


def test_delayed_scaling_is_refused():
    _, step = _setup(mf.DelayedScaling())
    run = mf.make_graphed_step(step, num_warmup_iters=1)
    x = _inputs(1)[0]
    run(x)
    with pytest.raises(NotImplementedError, match="does not capture delayed scaling"):
        run(x)
