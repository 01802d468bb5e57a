"""Recovery from a killed rank (issue 20, item 4): the example trainer (lab/train.py) checkpoints
every 2 steps through torch.distributed.checkpoint (written, then renamed); one rank kills
itself with SIGKILL in the middle of step 3; `--resume` continues from the last complete
checkpoint (after step 2) and ends with the final weights of an uninterrupted run, bit for bit
(a SHA-256 of the full weights). 2 gloo processes: the killed and the resumed run under
torchrun, as a user runs them; the runs they are compared with, and the other resumptions, are
the same trainer on forked ranks (test_train_example.py says why)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minifloat.lab import train_checkpoint

from .launch import run_ranks
from .test_train_example import _train_on_rank

ARGS = ["--preset", "tiny", "--recipe", "fp8-delayed", "--steps", "6", "--checkpoint-every",
        "2", "--print-digest"]


def _train(folder: Path, *extra: str, kill_at: str | None = None, args: list[str] = ARGS
           ) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("MINIFLOAT_TRAIN_KILL_AT", None)
    if kill_at:
        environment["MINIFLOAT_TRAIN_KILL_AT"] = kill_at
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "minifloat.lab.train", *args,
               "--checkpoint-dir", str(folder), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=environment)


def _forked(folder: Path, *extra: str, args: list[str] = ARGS) -> str:
    """Rank 0's stdout of the trainer on 2 forked ranks."""
    return run_ranks(_train_on_rank, 2, [*args, "--checkpoint-dir", str(folder), *extra],
                     timeout=180)[0]


def _digest(output: str) -> str:
    (digest,) = re.findall(r"^weights sha256 ([0-9a-f]{64})$", output, flags=re.MULTILINE)
    return digest


def test_a_killed_rank_resumes_from_the_last_complete_checkpoint_exactly(tmp_path):
    whole = _forked(tmp_path / "whole")
    killed = _train(tmp_path / "killed", kill_at="3:1")
    assert killed.returncode != 0 and "step    3" not in killed.stdout
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["step0000002"]
    resumed = _train(tmp_path / "killed", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after 2 steps" in resumed.stdout and "step    2" in resumed.stdout
    assert _digest(resumed.stdout) == _digest(whole)
    # a damaged checkpoint is an error that names it
    latest = train_checkpoint.latest(tmp_path / "killed")
    assert latest is not None and latest.name == "step0000006"
    for file in latest.iterdir():
        if file.suffix == ".distcp":
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=re.escape(f"cannot read the checkpoint {latest}")):
        _forked(tmp_path / "killed", "--resume")


@pytest.mark.parametrize("mode", [
    # quantized_model_init weights sharded as bytes: their bytes and scales, the fp32 master
    # rows and the masters' AdamW state are in the checkpoint
    ["--mode", "qw", "--recipe", "fp8-current"],
    # 2 TP ranks: each rank's slices under its own keys (one set would overwrite the other)
    ["--tp", "2", "--recipe", "fp8-delayed"],
], ids=["quantized-weights", "tensor-parallel"])
def test_resume_with_quantized_weights_or_tensor_parallel(tmp_path, mode):
    args = ["--preset", "tiny", "--steps", "4", "--checkpoint-every", "2", "--print-digest",
            *mode]
    whole = _forked(tmp_path, args=args)  # checkpoints after steps 2 and 4
    shutil.rmtree(tmp_path / "step0000004")
    resumed = _forked(tmp_path, "--resume", args=args)
    assert "after 2 steps" in resumed
    assert _digest(resumed) == _digest(whole)


def test_an_unfinished_save_is_never_resumed_from(tmp_path):
    (tmp_path / "step0000002").mkdir()
    (tmp_path / "step0000004.tmp").mkdir()  # killed while writing
    (tmp_path / "notes").mkdir()
    assert train_checkpoint.latest(tmp_path) == tmp_path / "step0000002"
    assert train_checkpoint.latest(tmp_path / "missing") is None
