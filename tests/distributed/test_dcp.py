"""torch.distributed.checkpoint (DCP) of an FSDP2 model of minifloat modules (issue 20, item 3
part): saved on 2 gloo ranks through get_model_state_dict (with dcp.async_save), loaded in one
process into a plain (unsharded) model, and on 4 ranks into FSDP2 shards (resharding 2 -> 1 and
2 -> 4); saved on 4, loaded on 2 (4 -> 2). The weights and every module's recipe state
(`_extra_state`: delayed scaling's reduced amax histories and scales, one bytes value per
module, which DCP saves and restores whole) arrive, so the loaded model's next forward equals
the single process's that trained on the same global batches, bit for bit."""

from __future__ import annotations

import torch

import minifloat as mf

from .launch import device_mesh, run_ranks
from .test_fsdp2 import WORLD, batches, build, loss_of, shard, train_sharded

RECIPE = mf.DelayedScaling(amax_history_len=4)


def save_worker(rank: int, world_size: int, folder: str) -> dict:
    """Train the FSDP2 model as test_fsdp2 does, then save it asynchronously; what was saved
    (full weights and decoded recipe state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = shard(build("modules"), device_mesh((world_size,)))
    train_sharded(model, RECIPE, rank, world_size)
    dcp.async_save(get_model_state_dict(model), checkpoint_id=folder).result()
    return full_state(model)


def full_state(model) -> dict:
    from minifloat.modules.extra_state import decode

    state = model.state_dict()
    return {"weights": {k: v.full_tensor() for k, v in state.items()
                        if isinstance(v, torch.Tensor)},
            "extra": {k: decode(v) for k, v in state.items() if k.endswith("_extra_state")}}


def load_worker(rank: int, world_size: int, folder: str) -> dict:
    """Load the 2-rank checkpoint into a 4-rank FSDP2 model: full weights and recipe state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(rank + 7)  # other initial weights on every rank: all must be loaded
    model = shard(build("modules"), device_mesh((world_size,)))
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)
    return full_state(model)


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


def test_dcp_saved_on_two_ranks_loads_on_one_and_on_four(tmp_path):
    import torch.distributed.checkpoint as dcp

    from minifloat.modules.extra_state import decode

    folder = str(tmp_path / "checkpoint")
    run_ranks(save_worker, WORLD, folder, timeout=180)
    torch.manual_seed(123)
    loaded = build("modules")  # built, then every weight and state comes from the checkpoint
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=folder)  # no process group here: DCP reads it alone
    loaded.load_state_dict(state)
    want = single_process_model()
    want_state = want.state_dict()  # before the forward below records new amaxes into it
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

    for rank, result in enumerate(run_ranks(load_worker, 4, folder, timeout=180)):
        for key, value in result["weights"].items():
            assert torch.equal(value, want_state[key]), f"rank {rank} {key}"
        for key, payload in result["extra"].items():
            expected_entries = decode(want_state[key])["recipes"]
            assert len(payload["recipes"]) == len(expected_entries) == 1
            saved, mine = expected_entries[0], payload["recipes"][0]
            for a, b in zip(mine["forward"] + mine["backward"],
                            saved["forward"] + saved["backward"], strict=True):
                assert torch.equal(a.cpu(), b.cpu()), f"rank {rank} {key}"  # NCCL: a on a GPU


def test_dcp_saved_on_four_ranks_loads_on_two(tmp_path):
    """Resharding 4 -> 2: what two ranks load is what four saved (weights and recipe state)."""
    folder = str(tmp_path / "checkpoint")
    saved = run_ranks(save_worker, 4, folder, timeout=180)[0]
    for rank, loaded in enumerate(run_ranks(load_worker, 2, folder, timeout=180)):
        assert loaded["weights"].keys() == saved["weights"].keys()
        for key, value in saved["weights"].items():
            assert torch.equal(loaded["weights"][key], value), f"rank {rank} {key}"
        for key, payload in saved["extra"].items():
            (mine,), (want,) = loaded["extra"][key]["recipes"], payload["recipes"]
            assert mine["recipe"] == want["recipe"]
            for a, b in zip(mine["forward"] + mine["backward"],
                            want["forward"] + want["backward"], strict=True):
                assert torch.equal(a.cpu(), b.cpu()), f"rank {rank} {key}"  # NCCL: a on a GPU
