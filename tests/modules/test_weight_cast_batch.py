"""The eager batched weight cast (modules/weight_cast_batch.py) against casting each weight alone.

Without a GPU the lean path is widened to the CPU (lean_fp8.DEVICES) and the batch casts each
weight with its own cast (no kernels): these tests check the bookkeeping (who joins, when copies
are stale, that they are taken once and not held), and that training with the batch equals
training without it bit for bit. tests/gpu/test_weight_cast_batch_cuda.py checks the
multi-tensor kernel's bytes against the single casts and the same training equality on a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

import minifloat as mf
from minifloat.modules import lean_fp8, weight_cast_batch
from minifloat.modules.base import QuantizedModule
from minifloat.modules.weight_cast_batch import EagerWeightCastBatch

CURRENT = mf.Float8CurrentScaling()


@pytest.fixture
def on_cpu(monkeypatch):
    """The lean path on the CPU, a fresh registry of batches, and the weights each batch cast."""
    monkeypatch.setattr(lean_fp8, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(weight_cast_batch, "_BATCHES", {})
    cast_sizes = []
    original = EagerWeightCastBatch._cast

    def counting(self, weights, casts):
        cast_sizes.append(len(weights))
        return original(self, weights, casts)

    monkeypatch.setattr(EagerWeightCastBatch, "_cast", counting)
    return cast_sizes


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(mf.Linear(64, 96), torch.nn.GELU(), mf.Linear(96, 64),
                               mf.LayerNormMLP(64, 128, normalization="RMSNorm"))


def batches(steps: int = 4, micro: int = 1, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(32, 64, generator=g) for _ in range(micro)] for _ in range(steps)]


def train(net: torch.nn.Module, data: list[list[torch.Tensor]], recompute: bool = False,
          recipe: mf.Recipe = CURRENT) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for micro_batches in data:
        for x in micro_batches:
            with mf.autocast(recipe=recipe):
                y = mf.checkpoint(net, x) if recompute else net(x)
                loss = y.float().square().mean()
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def unbatched(monkeypatch, net_seed: int, data, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(weight_cast_batch, "ENABLED", False)
        net = model(net_seed)
        return net, train(net, data, **kwargs)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_one_batch_per_step_and_the_bytes_of_single_casts(on_cpu, monkeypatch):
    data = batches(steps=4)
    net = model()
    losses = train(net, data)
    # step 1: the four weights join (each cast alone); every later step: one batch of four
    assert on_cpu == [4, 4, 4]
    assert weight_cast_batch.batches_run() == 3
    reference_net, reference = unbatched(monkeypatch, 0, data)
    assert_same(losses, reference)
    assert_same(list(net.parameters()), list(reference_net.parameters()))


def test_copies_are_taken_once_and_not_held(on_cpu):
    net = model()
    train(net, batches(steps=2))
    (batch,) = weight_cast_batch._BATCHES.values()
    assert batch.copies == {}, "forward keeps no copy in the batch"
    assert len(batch.members) == 4


def test_every_micro_batch_gets_a_batch_and_recompute_casts_alone(on_cpu, monkeypatch):
    """Each micro-batch enters autocast (a forward pass): one batch each, after the first
    pass, where the weights join; activation recompute in backward casts alone."""
    data = batches(steps=3, micro=3)
    net = model()
    losses = train(net, data, recompute=True)
    assert on_cpu == [4] * 8
    _, reference = unbatched(monkeypatch, 0, data, recompute=True)
    assert_same(losses, reference)


def test_micro_batches_under_one_autocast_get_one_batch(on_cpu, monkeypatch):
    def run() -> list[torch.Tensor]:
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        for micro_batches in batches(steps=3, micro=3):
            with mf.autocast(recipe=CURRENT):
                for x in micro_batches:
                    loss = net(x).float().square().mean()
                    loss.backward()
                    losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return losses

    losses = run()
    assert on_cpu == [4, 4], "steps 2 and 3: their first micro-batch only"
    monkeypatch.setattr(weight_cast_batch, "ENABLED", False)
    assert_same(losses, run())


def test_weights_changed_in_place_are_cast_again(on_cpu, monkeypatch):
    x = torch.randn(32, 64)

    def run() -> list[torch.Tensor]:
        net = model()
        outputs = []
        for scale in (1.0, 2.0, 0.5):
            with torch.no_grad():
                for layer in (net[0], net[2]):
                    layer.weight.mul_(scale)  # bumps the version counters, no optimizer step
            with mf.autocast(recipe=CURRENT):
                y = net(x)
            y.float().sum().backward()
            outputs.append(y.detach())
        return outputs

    batched = run()
    assert on_cpu == [4, 4], "a batch at each forward pass after the first"
    monkeypatch.setattr(weight_cast_batch, "ENABLED", False)
    assert_same(batched, run())


class DataSGD(torch.optim.Optimizer):
    """Changes parameters through .data: no version counter moves (as fused steps do)."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_step_that_bumps_no_version_makes_copies_stale(on_cpu, monkeypatch):
    x = torch.randn(32, 64)

    def run() -> list[torch.Tensor]:
        net = model()
        optimizer = DataSGD(net.parameters(), lr=0.5)
        outputs = []
        for _ in range(3):
            with mf.autocast(recipe=CURRENT):
                y = net(x)
            y.float().square().mean().backward()
            outputs.append(y.detach())
            optimizer.step()
            net.zero_grad(set_to_none=True)
        return outputs

    batched = run()
    assert on_cpu == [4, 4]
    monkeypatch.setattr(weight_cast_batch, "ENABLED", False)
    assert_same(batched, run())


def test_a_deleted_model_leaves_and_stale_copies_are_dropped(on_cpu):
    net = model()
    train(net, batches(steps=2))
    (batch,) = weight_cast_batch._BATCHES.values()
    first, second = net[0], net[2]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    optimizer.step()  # every weight stale
    x = torch.randn(32, 64)
    with mf.autocast(recipe=CURRENT):
        first(x).sum().backward()  # the batch casts all four (the last pass used them)
    assert len(batch.copies) == 3, "three not taken"
    optimizer.step()
    with mf.autocast(recipe=CURRENT):
        second(torch.randn(32, 96)).sum().backward()
    # the stale copies are dropped; `second` was last used in the pass that used all but
    # `first`: a batch of those three, two not taken
    assert on_cpu[-1] == 3 and len(batch.copies) == 2
    del net, first, second, optimizer
    gc.collect()
    assert batch.members == {} and batch.copies == {}


def test_a_model_trained_in_turn_with_another_is_not_cast_for_the_other(on_cpu, monkeypatch):
    """Two models trained in turn (each pass one): each batch casts the weights its pass uses,
    not the other model's, which the last pass did not use."""
    data = batches(steps=4)

    def run():
        nets = model(0), model(1)
        optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in nets]
        losses = []
        for (x,) in data:
            for net, optimizer in zip(nets, optimizers, strict=True):
                with mf.autocast(recipe=CURRENT):
                    loss = net(x).float().square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
        return losses

    losses = run()
    # passes 1 and 2: each model's weights join; every later pass: a batch of its model's four
    assert on_cpu == [4] * 6
    monkeypatch.setattr(weight_cast_batch, "ENABLED", False)
    assert_same(losses, run())


def test_what_the_batch_leaves_alone(on_cpu):
    x = torch.randn(32, 64)
    lin = mf.Linear(64, 48)
    for _ in range(3):  # inference: no batch
        with torch.no_grad(), mf.autocast(recipe=CURRENT):
            lin(x)
    frozen = mf.Linear(64, 48)
    frozen.weight.requires_grad_(False)
    for _ in range(3):
        with mf.autocast(recipe=CURRENT):
            frozen(x.clone().requires_grad_(True)).sum().backward()
    assert on_cpu == []
    assert all(len(batch.members) == 0 for batch in weight_cast_batch._BATCHES.values())


def test_fsdp2_layers_are_left_out_and_cast_alone(on_cpu, monkeypatch, one_rank_group):
    """FSDP2 (high-precision gather) registers a layer's unsharded weight only from its
    pre-forward on; before that its storage is freed (or being written by the all-gather), so a
    batch must not read it: the layers are left out and each casts alone, as without the batch."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    data = batches(steps=3)

    def sharded_run(enabled: bool):
        with monkeypatch.context() as patch:
            patch.setattr(weight_cast_batch, "ENABLED", enabled)
            net = model()
            mesh = DeviceMesh("cpu", [0])
            for layer in (net[0], net[2], net[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            return train(net, data)

    losses = sharded_run(True)
    assert on_cpu == [], "no batch over FSDP2's layers"
    (batch,) = weight_cast_batch._BATCHES.values()
    assert batch.members == {} or len(batch.members) == 1
    assert_same(losses, sharded_run(False))


def test_a_layer_run_twice_in_a_pass_casts_alone_the_second_time(on_cpu, monkeypatch):
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inner, self.outer = mf.Linear(64, 64), mf.Linear(64, 64)

        def forward(self, x):
            return self.outer(self.inner(self.inner(x)))

    data = batches(steps=3)
    losses = train(Twice(), data)
    assert on_cpu == [2, 2], "one batch of the two weights a pass; the second use casts alone"
    monkeypatch.setattr(weight_cast_batch, "ENABLED", False)
    assert_same(losses, train(Twice(), data))


def test_forward_passes_count_outermost_autocasts_only():
    """autocast.forward_pass, which the batch keys on: nested autocasts, disabled ones and
    activation recompute's replays in backward start no new pass."""
    from minifloat.autocast import forward_pass

    lin = mf.Linear(64, 64)
    start = forward_pass()
    with mf.autocast(recipe=CURRENT):
        assert forward_pass() == start + 1
        with mf.autocast(recipe=CURRENT):
            y = mf.checkpoint(lin, torch.randn(32, 64, requires_grad=True))
        assert forward_pass() == start + 1
    with mf.autocast(enabled=False):
        pass
    y.sum().backward()  # the recompute replays the forward under its recorded autocast
    assert forward_pass() == start + 1


DELAYED = mf.DelayedScaling(amax_history_len=4)


def recipe_states(net: torch.nn.Module, recipe: mf.Recipe | None = None) -> list[torch.Tensor]:
    """Every delayed-scaling scale and amax history of net's modules (their extra state), of
    every recipe or of `recipe`."""
    return [tensor for module in net.modules() if isinstance(module, QuantizedModule)
            for key, (forward, backward) in module._recipe_states.items()
            if recipe is None or key == recipe
            for tensor in (*forward.state_tensors(), *backward.state_tensors())]


def test_delayed_scaling_batches_with_the_recipe_states_of_single_casts(on_cpu, monkeypatch):
    """Delayed scaling: each weight cast with its module's scale, its amax folded into its
    slot; losses, weights and every recipe state equal those of casting each alone."""
    from minifloat.autocast import update_delayed_backward_scales

    data = batches(steps=4, micro=2)
    net = model()
    losses = train(net, data, recipe=DELAYED)
    update_delayed_backward_scales()  # the last backward's, before the next run's autocast
    assert on_cpu == [4] * 7, "every pass after the first: copies live one pass only"
    reference_net, reference = unbatched(monkeypatch, 0, data, recipe=DELAYED)
    update_delayed_backward_scales()
    assert_same(losses, reference)
    assert_same(list(net.parameters()), list(reference_net.parameters()))
    assert_same(recipe_states(net), recipe_states(reference_net))


def test_a_switch_of_delayed_recipe_casts_with_the_new_states(on_cpu, monkeypatch):
    """After a switch to another delayed recipe (new recipe states), the first pass's batch still
    holds the old states' casts for the members not yet seen under the new one: their copies are
    not taken (each casts alone with its new state; the old states' slots get their amaxes) and
    every later batch uses the new states."""
    from minifloat.autocast import update_delayed_backward_scales

    second = mf.DelayedScaling(amax_history_len=8)

    def run() -> tuple[torch.nn.Module, list[torch.Tensor]]:
        net = model()
        losses = train(net, batches(steps=2), recipe=DELAYED)
        losses += train(net, batches(steps=3, seed=2), recipe=second)
        update_delayed_backward_scales()
        return net, losses

    net, losses = run()
    assert on_cpu[-2:] == [4, 4], "the last two passes batch under the new states"
    monkeypatch.setattr(weight_cast_batch, "ENABLED", False)
    reference_net, reference = run()
    assert_same(losses, reference)
    assert_same(list(net.parameters()), list(reference_net.parameters()))
    new_states = recipe_states(net, second)
    assert new_states and len(recipe_states(net)) == 2 * len(new_states)
    assert_same(new_states, recipe_states(reference_net, second))
