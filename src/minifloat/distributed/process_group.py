"""Tearing a process group down without aborting the process."""

from __future__ import annotations

import gc

import torch.distributed as dist


def destroy_process_group() -> None:
    """torch.distributed.destroy_process_group, after a barrier and with the reference cycles
    that hold the group (FSDP2 state, DTensors) collected before and after.

    Why: on gloo, plain bf16 FSDP2 training aborted at interpreter exit in 2 runs of 10
    ("terminate called without an active exception") when the group was destroyed while such
    cycles still held it; with the barrier and the collections 22 runs of 22 exited cleanly."""
    if not dist.is_initialized():
        return
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
