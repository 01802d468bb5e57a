"""make_graphed_step's checks that need no GPU (the capture itself: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf


def test_no_warm_up_is_refused():
    with pytest.raises(ValueError, match="num_warmup_iters must be at least 1"):
        mf.make_graphed_step(lambda x: x, num_warmup_iters=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_the_error_says_so():
    run = mf.make_graphed_step(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        run(torch.ones(2))
