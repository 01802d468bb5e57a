"""Run a function on N real processes over gloo (torch.multiprocessing spawn), for CPU tests.

Each test names a module-level worker `fn(rank, world_size, *args)`; `run_ranks` starts the
processes on a free local port, waits at most `timeout` seconds (a hang fails the test instead
of stalling CI), and raises with every failing rank's traceback. Results travel through files
(torch.save under a temporary directory), not through queues: tensors put on a queue are shared
memory that disappears when the process exits.
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, folder: str, fn: Callable, args: tuple
           ) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks share the CI machine's cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    except BaseException:
        (Path(folder) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` processes; returns each rank's result."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_entry, args=(world_size, free_port(), folder, fn, args),
                                     nprocs=world_size, join=False, start_method="spawn")
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
        return [torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False)
                for rank in range(world_size)]
