"""Checkpoints of the example trainer (lab/train.py): every K steps, through
torch.distributed.checkpoint, so that a job killed mid-step resumes exactly (issue 20, item 4).

Each checkpoint is a DCP folder `step{N:07d}` under --checkpoint-dir holding the FSDP2 model
and optimizer state (get_state_dict: sharded, recipe state included as each module's
`_extra_state`), the number of steps done, the batch generator's state and each rank's torch
RNG states (stochastic rounding draws from them). It is written as
`step{N}.tmp` and renamed by rank 0 after every rank has finished writing, so a folder without
the suffix is complete: a kill during a save leaves only a `.tmp` folder, which resume ignores.
Delayed scaling's last backward amaxes are folded in before saving (update_delayed_backward_
scales), as the next autocast entry would do. A checkpoint that cannot be read (truncated or
corrupted files) raises an error that names its folder.

`--mode qw` adds the fp32 master rows and their AdamW state (train.MasterWeights.state_dict,
sharded like the weights); the model's quantized weights are saved as their bytes and scales
(distributed/shard_state_dict.py). Under `--tp` each TP rank's parameters are its own slices
of the weights with the same names on every TP rank, so its state goes under `tp{rank}`: DCP
would otherwise keep one TP rank's slices for all. Resuming then needs the same TP size (the
data-parallel size may differ, except for the per-rank RNG states, which need the same world).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..autocast import update_delayed_backward_scales

_COMPLETE = re.compile(r"step(\d{7})")


def _name(step: int) -> str:
    return f"step{step:07d}"


def latest(folder: str | Path) -> Path | None:
    """The complete checkpoint of the most steps under `folder`, or None."""
    root = Path(folder)
    if not root.is_dir():
        return None
    complete = [path for path in root.iterdir()
                if path.is_dir() and _COMPLETE.fullmatch(path.name)]
    return max(complete, key=lambda path: int(path.name[4:]), default=None)


def _scope(tp_rank: int | None) -> str:
    return "training" if tp_rank is None else f"tp{tp_rank}"


def _state(model, optimizer, tp_rank: int | None, masters) -> dict:
    """What is saved and loaded in place: {scope: {model, optimizer[, masters]}}."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if masters is not None:
        state["masters"] = masters.state_dict()
    return {_scope(tp_rank): state}


def save(folder: str | Path, steps_done: int, model, optimizer,
         generator: torch.Generator, *, tp_rank: int | None = None, masters=None) -> Path:
    """Write the checkpoint after `steps_done` steps (all ranks call this). tp_rank: this
    rank's place in its TP group (None without TP); masters: train.MasterWeights (--mode qw)."""
    import torch.distributed.checkpoint as dcp

    update_delayed_backward_scales()
    root = Path(folder)
    final = root / _name(steps_done)
    temporary = root / (final.name + ".tmp")
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)  # a save killed earlier
    dist.barrier()
    state = _state(model, optimizer, tp_rank, masters)
    state["progress"] = {"steps_done": torch.tensor(steps_done),
                         "generator": generator.get_state(), **_rng_states()}
    dcp.save(state, checkpoint_id=str(temporary))
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        temporary.rename(final)
    dist.barrier()
    return final


def load(path: str | Path, model, optimizer, generator: torch.Generator, *,
         tp_rank: int | None = None, masters=None) -> int:
    """Restore a checkpoint into the (sharded) model, optimizer, masters and generator; the
    steps done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer, tp_rank, masters)
    state["progress"] = {"steps_done": torch.tensor(0), "generator": generator.get_state(),
                         **_rng_states()}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's is a BaseException
        raise RuntimeError(f"cannot read the checkpoint {path} ({type(error).__name__}: "
                           f"{error}); delete it to resume from an earlier one") from None
    scoped = state[_scope(tp_rank)]  # the masters were loaded in place
    set_state_dict(model, optimizer, model_state_dict=scoped["model"],
                   optim_state_dict=scoped["optimizer"])
    generator.set_state(state["progress"]["generator"])
    rank = dist.get_rank()
    torch.set_rng_state(state["progress"][f"rng_cpu_rank{rank}"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["progress"][f"rng_cuda_rank{rank}"])
    return int(state["progress"]["steps_done"])


def _rng_states() -> dict[str, torch.Tensor]:
    """This rank's torch RNG states, under keys of its own (DCP keeps one copy of a key that
    every rank saves alike)."""
    rank = dist.get_rank()
    states = {f"rng_cpu_rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available():
        states[f"rng_cuda_rank{rank}"] = torch.cuda.get_rng_state()
    return states
