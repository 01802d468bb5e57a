"""make_graphed_step's checks that need no GPU (the capture itself: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from train_steps import loss_step


def test_no_warm_up_is_refused():
    with pytest.raises(ValueError, match="num_warmup_iters must be at least 1"):
        mf.make_graphed_step(lambda x: x, num_warmup_iters=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_the_error_says_so():
    run = mf.make_graphed_step(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        run(torch.ones(2))


class _Recorder:
    """Stand-ins for torch.cuda's stream and graph calls: a capture runs the step once, a replay
    only counts (the logic around them is what these tests check; tests/gpu captures)."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def install(self, monkeypatch) -> None:
        import contextlib

        import minifloat.step_graphs as step_graphs

        recorder = self

        class Stream:
            def wait_stream(self, other) -> None:
                pass

        class Graph:
            def replay(self) -> None:
                recorder.replays += 1

        @contextlib.contextmanager
        def graph(_graph, capture_error_mode=None):
            recorder.captures += 1
            yield

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda _: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(step_graphs, "_require_cuda", lambda leaves: None)


def _training_step(recipe=None):
    model = mf.Linear(32, 32)
    inner = loss_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      recipe or mf.Float8CurrentScaling())
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return inner(x)

    return step, calls


def test_warm_up_then_one_capture_then_replays(monkeypatch):
    from minifloat import optimizer_steps

    recorder = _Recorder()
    recorder.install(monkeypatch)
    optimizer_steps.watch()
    step, calls = _training_step()
    run = mf.make_graphed_step(step, num_warmup_iters=2)
    x = torch.randn(16, 32)
    for _ in range(2):
        run(x)
    assert (len(calls), recorder.captures, recorder.replays) == (2, 0, 0)
    run(x)  # captures (the step's Python runs once more) and replays
    assert (len(calls), recorder.captures, recorder.replays) == (3, 1, 1)
    before = optimizer_steps.count()
    run(torch.randn(16, 32))
    run(torch.randn(16, 32))
    assert (len(calls), recorder.captures, recorder.replays) == (3, 1, 3)
    # each replay took the optimizer step it captured: the weight caches must see it
    assert optimizer_steps.count() - before == 2


def test_a_replay_refuses_another_shape(monkeypatch):
    _Recorder().install(monkeypatch)
    step, _ = _training_step()
    run = mf.make_graphed_step(step, num_warmup_iters=1)
    run(torch.randn(16, 32))
    run(torch.randn(16, 32))
    with pytest.raises(ValueError, match="replays the arguments it was captured with"):
        run(torch.randn(8, 32))


def test_delayed_scaling_is_refused_at_capture(monkeypatch):
    _Recorder().install(monkeypatch)
    step, _ = _training_step(mf.DelayedScaling())
    run = mf.make_graphed_step(step, num_warmup_iters=1)
    run(torch.randn(16, 32))
    with pytest.raises(NotImplementedError, match="does not capture delayed scaling"):
        run(torch.randn(16, 32))


def test_a_capture_failure_names_the_usual_causes(monkeypatch):
    _Recorder().install(monkeypatch)

    def step(x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_available() and getattr(step, "warm", False):
            raise RuntimeError("operation not permitted when stream is capturing")
        step.warm = True
        return x

    run = mf.make_graphed_step(step, num_warmup_iters=1)
    run(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"\.item\(\), \.cpu\(\).*capturable=True"):
        run(torch.ones(2))
