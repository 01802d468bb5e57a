"""MINIFLOAT_TEST_SHARD splits a test file's tests over processes (scripts/gpu-check): every test
runs in exactly one shard, and a malformed spec is an error, not a silent full run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

SAMPLE = "\n".join(f"def test_case_{i}():\n    pass\n" for i in range(7))


@pytest.fixture
def sample(pytester: pytest.Pytester) -> pytest.Pytester:
    """A directory holding the suite's conftest and a file of seven tests."""
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_sample=SAMPLE)
    return pytester


def _collected(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, shard: str | None
               ) -> tuple[int, list[str]]:
    """(exit code, collected test names) of a collection run under the given shard spec. The
    run is in-process (pytester): a pytest subprocess per spec had cost 2-3 s each on the CPU
    machine, 18 s for the file."""
    monkeypatch.delenv("MINIFLOAT_TEST_SHARD", raising=False)
    if shard is not None:
        monkeypatch.setenv("MINIFLOAT_TEST_SHARD", shard)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                          "--collect-only", "test_sample.py")
    return int(result.ret), re.findall(r"test_case_\d+", "\n".join(result.outlines))


def test_shards_partition_the_tests(sample, monkeypatch):
    _, everything = _collected(sample, monkeypatch, None)
    assert len(everything) == 7
    shards = [_collected(sample, monkeypatch, f"{i}/3")[1] for i in range(3)]
    assert sorted(name for shard in shards for name in shard) == sorted(everything)
    assert [len(shard) for shard in shards] == [3, 2, 2]


def test_malformed_shard_is_an_error(sample, monkeypatch):
    for spec in ("3/3", "one/two", "1"):
        code, _ = _collected(sample, monkeypatch, spec)
        assert code != 0, spec
