"""Fixtures shared by the CPU test suites."""

import pytest


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group (skips where none can start): amax reduction groups."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = False
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        except (RuntimeError, ValueError) as error:  # e.g. no usable network interface
            pytest.skip(f"cannot start a one-rank gloo group here: {error}")
        created = True
    if dist.get_world_size() != 1:
        pytest.skip("a process group of several ranks is already initialised")
    group = dist.new_group([0])
    yield group
    if created:
        dist.destroy_process_group()


# Files whose tests each launch torchrun (several processes, 10-75 s a test on the CPU machine):
# run first, so that under pytest-xdist (scripts/test) none of them starts last and leaves the
# other worker idle at the end (the suite's last minutes were these tests alone).
LONG_FIRST = ("tests/distributed/test_train_example.py", "tests/distributed/test_train_recovery.py")


def pytest_collection_modifyitems(config, items):
    """The long torchrun files first (LONG_FIRST); then MINIFLOAT_TEST_SHARD="i/n" keeps every
    n-th collected test starting at i (0-based).

    Why: scripts/gpu-check runs test files as parallel processes, and the GPU tests spend most of
    their time compiling Triton kernels on one CPU core per process; one file held the whole run
    for six minutes. Shards of a file run in parallel processes; together they run every test
    exactly once (tests/test_sharding.py checks the split)."""
    import os

    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))  # stable: keeps order
    spec = os.environ.get("MINIFLOAT_TEST_SHARD")
    if not spec:
        return
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(
            f"MINIFLOAT_TEST_SHARD must look like 0/3 (shard index / shard count), got {spec!r}"
        ) from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"MINIFLOAT_TEST_SHARD {spec!r}: need 0 <= index < count")
    kept, dropped = [], []
    for position, item in enumerate(items):
        (kept if position % count == index else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
