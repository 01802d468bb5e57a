"""Under MINIFLOAT_DIST_BACKEND=nccl the test process computes its references on cuda:0, where
the ranks' results are loaded (launch.py); without GPUs those runs skip."""

import pytest
import torch

from .launch import backend


@pytest.fixture(autouse=True, scope="session")
def reference_device():
    if backend() != "nccl":
        yield
        return
    if not torch.cuda.is_available():
        pytest.skip("MINIFLOAT_DIST_BACKEND=nccl needs CUDA GPUs")
    previous = torch.get_default_device()
    torch.set_default_device("cuda:0")
    yield
    torch.set_default_device(previous)
