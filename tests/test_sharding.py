"""MINIFLOAT_TEST_SHARD splits a test file's tests over processes (scripts/gpu-check): every test
runs in exactly one shard, and a malformed spec is an error, not a silent full run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SAMPLE = "\n".join(f"def test_case_{i}():\n    pass\n" for i in range(7))


def _collected(tmp_path: Path, shard: str | None) -> tuple[int, list[str]]:
    env = dict(os.environ)
    env.pop("MINIFLOAT_TEST_SHARD", None)
    if shard is not None:
        env["MINIFLOAT_TEST_SHARD"] = shard
    conftest = Path(__file__).with_name("conftest.py")
    (tmp_path / "conftest.py").write_text(conftest.read_text())
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
         str(tmp_path / "test_sample.py")], capture_output=True, text=True, env=env,
        cwd=tmp_path)
    return result.returncode, re.findall(r"test_case_\d+", result.stdout)


def test_shards_partition_the_tests(tmp_path):
    _, everything = _collected(tmp_path, None)
    assert len(everything) == 7
    shards = [_collected(tmp_path, f"{i}/3")[1] for i in range(3)]
    assert sorted(name for shard in shards for name in shard) == sorted(everything)
    assert [len(shard) for shard in shards] == [3, 2, 2]


def test_malformed_shard_is_an_error(tmp_path):
    for spec in ("3/3", "one/two", "1"):
        code, _ = _collected(tmp_path, spec)
        assert code != 0, spec
