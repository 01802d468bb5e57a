"""torch.distributed.checkpoint (DCP) of an FSDP2 model of minifloat modules (issue 20, item 3
part): saved on 2 gloo ranks through get_model_state_dict, loaded in one process into a plain
(unsharded) model. The weights and every module's recipe state (`_extra_state`: delayed
scaling's reduced amax histories and scales, one bytes value per module, which DCP saves and
restores whole) arrive, so the loaded model's next forward equals the single process's that
trained on the same global batches, bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist

import minifloat as mf

from .launch import device_mesh, run_ranks
from .test_fsdp2 import WORLD, batches, build, loss_of, shard

RECIPE = mf.DelayedScaling(amax_history_len=4)


def save_worker(rank: int, world_size: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = shard(build("modules"), device_mesh((world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches():
        with mf.autocast(recipe=RECIPE, amax_reduction_group=dist.group.WORLD):
            loss = loss_of(model, x.chunk(world_size)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mf.update_delayed_backward_scales()
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)


def single_process_model() -> torch.nn.Module:
    """test_fsdp2's reference: both halves of each batch as micro-batches, gradients halved."""
    model = build("modules")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches():
        with mf.autocast(recipe=RECIPE):
            for piece in x.chunk(WORLD):
                loss_of(model, piece).backward()
        for parameter in model.parameters():
            parameter.grad /= WORLD
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mf.update_delayed_backward_scales()
    return model


def test_dcp_saved_on_two_ranks_loads_in_one_process_with_recipe_state(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = str(tmp_path / "checkpoint")
    run_ranks(save_worker, WORLD, folder, timeout=180)
    torch.manual_seed(123)
    loaded = build("modules")  # built, then every weight and state comes from the checkpoint
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=folder)  # no process group here: DCP reads it alone
    loaded.load_state_dict(state)
    want = single_process_model()
    for (key, a), b in zip(loaded.state_dict().items(), want.state_dict().values(),
                           strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), key
    x = batches()[0][:64] * 2 + 1  # scaled so that the saved scales, not fresh ones, decide
    with mf.autocast(recipe=RECIPE):
        got, expected = loaded(x), want(x)
    assert torch.equal(got, expected)
    fresh = build("modules")
    fresh.load_state_dict({k: v for k, v in state.items() if "_extra_state" not in k},
                          strict=False)
    with mf.autocast(recipe=RECIPE):
        assert not torch.equal(fresh(x), expected)  # the recipe state is what made them equal
