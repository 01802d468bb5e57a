"""Run a function on N real processes (torch.multiprocessing spawn): gloo on the CPU, or NCCL.

Each test names a module-level worker `fn(rank, world_size, *args)`; `run_ranks` starts the
processes on a free local port, waits at most `timeout` seconds (a hang fails the test instead
of stalling CI), and raises with every failing rank's traceback. Results travel through files
(torch.save under a temporary directory), not through queues: tensors put on a queue are shared
memory that disappears when the process exits.

MINIFLOAT_DIST_BACKEND=nccl (scripts/gpu-multi) runs the same tests on GPUs: rank r uses
cuda:r as its default device, the test process (which computes the one-rank references) uses
cuda:0, and ranks' results load onto cuda:0, so every bitwise comparison compares GPU results
of the same kernels. A test of more ranks than the machine has GPUs skips (NCCL puts one rank
on a GPU). Tests draw their inputs from CPU generators (`cpu_randn`), so both backends see the
same numbers, and build meshes with `device_mesh`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minifloat.distributed import destroy_process_group

BACKEND_VARIABLE = "MINIFLOAT_DIST_BACKEND"


def backend() -> str:
    """gloo (the CPU suite) or nccl, from MINIFLOAT_DIST_BACKEND."""
    name = os.environ.get(BACKEND_VARIABLE, "gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"{BACKEND_VARIABLE}={name!r}: use gloo (CPU) or nccl (GPUs)")
    return name


def device_type() -> str:
    return "cuda" if backend() == "nccl" else "cpu"


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """init_device_mesh on this backend's device type."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), shape, mesh_dim_names=names)


def cpu_randn(*shape: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
    """torch.randn drawn from a CPU generator (the same numbers under either backend), placed
    on the default device (cuda:rank under NCCL)."""
    values = torch.randn(*shape, generator=generator, dtype=dtype, device="cpu")
    return values.to(torch.get_default_device())


def use_backend_device(rank: int) -> None:
    """Under NCCL, make cuda:rank this process's device and default device."""
    if backend() == "nccl":
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, folder: str, fn: Callable, args: tuple
           ) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks share the CI machine's cores
    try:
        use_backend_device(rank)
        device_id = torch.device("cuda", rank) if backend() == "nccl" else None
        # under NCCL, gloo serves CPU tensors too (dcp.async_save stages through the CPU)
        name = "cpu:gloo,cuda:nccl" if backend() == "nccl" else "gloo"
        dist.init_process_group(name, rank=rank, world_size=world_size, device_id=device_id)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    except BaseException:
        (Path(folder) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_process_group()


# On the CPU, ranks are forked from a server process that has imported torch and minifloat once
# (and run no parallel work, so forking it is safe), not spawned: a spawned rank spent ~4 s
# importing them, and the suite starts ~80 rank groups (the whole suite ran 10 minutes on 2
# cores with spawn; test_tensor_parallel.py took 107 s, 24 s forked). GPU ranks are spawned: a
# CUDA runtime must not be inherited through a fork.
START_METHOD = "spawn" if backend() == "nccl" else "forkserver"
mp.set_forkserver_preload(["torch", "torch.distributed", "minifloat", "minifloat.distributed"])


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` processes; returns each rank's result
    (on the default device of the calling process). A free port can be taken by another test
    process between our probe and the ranks' bind: such a start is tried again, once."""
    if backend() == "nccl" and world_size > torch.cuda.device_count():
        import pytest

        pytest.skip(f"{world_size} ranks need {world_size} GPUs under NCCL; this machine has "
                    f"{torch.cuda.device_count()}")
    try:
        return _run_ranks_once(fn, world_size, args, timeout)
    except RuntimeError as error:
        if "EADDRINUSE" not in str(error):
            raise
        return _run_ranks_once(fn, world_size, args, timeout)


def _run_ranks_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_entry, args=(world_size, free_port(), folder, fn, args),
                                     nprocs=world_size, join=False, start_method=START_METHOD)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"{world_size} ranks did not finish in {timeout:.0f} s "
                                       "(a hang in a collective?)")
        except mp.ProcessRaisedException as error:
            errors = sorted(Path(folder).glob("rank*.err"))
            detail = "\n".join(f"{path.name}:\n{path.read_text()}" for path in errors)
            raise RuntimeError(f"a rank failed:\n{detail or error}") from None
        except mp.ProcessExitedException as error:
            raise RuntimeError(f"a rank exited: {error}") from None
        return [torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False,
                           map_location=torch.get_default_device())
                for rank in range(world_size)]
