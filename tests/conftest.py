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
