"""Activation recompute (minifloat.checkpoint) and CPU offload of saved tensors, for plain and
hybrid recipes: gradients equal the normal path bit for bit, and delayed-scaling bookkeeping is
the same with or without recompute (the recompute replays the forward's scales and records no
amax).

What a plain torch.utils.checkpoint does over minifloat modules inside autocast: the recompute
runs in backward, outside the autocast, so the modules recompute in high precision and save
different tensors. torch's determinism check notices (CheckpointError: "different metadata");
with determinism_check="none" backward fails on the mismatched buffers (a shape error). Neither
gives gradients silently; minifloat.checkpoint is the way to recompute.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.utils.checkpoint

import minifloat as mf
from minifloat import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    HybridQuantizer,
    HybridRecipe,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    numerics,
)
from training._reference import E4M3, E5M2, assert_bitwise_equal

IN, HIDDEN, BATCH = 64, 128, 32


def seed000_factory(role):
    """Seed 000's mixed factory (module level, so the recipe pickles)."""
    if role.tensor_type == "weight":
        return HybridQuantizer(mf.Float8CurrentScalingQuantizer(E4M3), mf.MXFP8Quantizer(E4M3))
    if role.tensor_type == "input":
        return HybridQuantizer(mf.Float8CurrentScalingQuantizer(E4M3), mf.NVFP4Quantizer())
    return HybridQuantizer(mf.MXFP8Quantizer(E5M2), mf.NVFP4Quantizer())


RECIPES = {
    # history of 2: the scales change between steps and between a forward and its backward
    "delayed": DelayedScaling(amax_history_len=2),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4-no-sr": NVFP4BlockScaling(disable_stochastic_rounding=True),
    # SR draws happen in backward only; the recomputed forward draws nothing from torch's
    # generator (and runs under torch's forked RNG state anyway), so the backward's SR draws are
    # the same with recompute: bit-identical too
    "nvfp4": NVFP4BlockScaling(),
    "hybrid-mx-nv": HybridRecipe(fprop=MXFP8BlockScaling(), dgrad=NVFP4BlockScaling(),
                                 wgrad=NVFP4BlockScaling()),
    "hybrid-delayed": HybridRecipe(fprop=DelayedScaling(amax_history_len=2),
                                   dgrad=Float8CurrentScaling(),
                                   wgrad=DelayedScaling(amax_history_len=2)),
    "seed000": CustomRecipe(seed000_factory),
}
DELAYED = ("delayed", "hybrid-delayed")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = mf.Linear(IN, HIDDEN, name="fc1")
        self.fc2 = mf.Linear(HIDDEN, IN, name="fc2")

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_data(step):
    g = torch.Generator().manual_seed(500 + step)
    # amaxes shrink from step to step: delayed scales move, and an amax wrongly recorded by a
    # recompute would outlive its step in the history
    scale = 0.5**step
    return torch.randn(BATCH, IN, generator=g) * scale, torch.randn(BATCH, IN, generator=g)


def train(recipe, mode="normal", steps=3, saved_hooks=None):
    """Results of each step of a Block trained with SGD; mode: "normal", "checkpoint"
    (minifloat.checkpoint inside autocast) or "autocast-inside" (minifloat.checkpoint outside
    autocast, of a function that enters autocast itself)."""
    torch.manual_seed(3)
    block = Block()
    optimizer = torch.optim.SGD(block.parameters(), lr=0.05)
    torch.manual_seed(4)  # stochastic rounding draws
    results = []
    for step in range(steps):
        x, dy = make_data(step)
        x.requires_grad_(True)
        with saved_hooks() if saved_hooks else contextlib.nullcontext():
            if mode == "autocast-inside":
                def run(t):
                    with mf.autocast(recipe=recipe):
                        return block(t)

                y = mf.checkpoint(run, x)
            else:
                with mf.autocast(recipe=recipe):
                    y = mf.checkpoint(block, x) if mode == "checkpoint" else block(x)
        y.backward(dy)
        grads = [p.grad.clone() for p in (block.fc1.weight, block.fc1.bias, block.fc2.weight,
                                          block.fc2.bias)]
        results.append([y.detach(), x.grad, *grads])
        optimizer.step()
        optimizer.zero_grad()
    return block, results


@functools.cache
def train_normally(kind, steps=3):
    """The reference run without recompute or hooks (shared by the tests; never mutated)."""
    block, results = train(RECIPES[kind], steps=steps)
    bookkeeping = delayed_bookkeeping(block, RECIPES[kind]) if kind in DELAYED else None
    return results, bookkeeping


LABELS = ("y", "x.grad", "fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad", "fc2.bias.grad")


def assert_same(actual, expected, what):
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        for label, a, e in zip(LABELS, got, want, strict=True):
            assert_bitwise_equal(a, e, f"{what}, step {step}: {label}")


def delayed_bookkeeping(block, recipe):
    """(amax_history, scale) of every delayed-scaling state of the block's layers."""
    out = []
    for layer in (block.fc1, block.fc2):
        for state in layer.recipe_states(recipe):
            out += [(s.amax_history.clone(), s.scale.clone()) for s in state.delayed_states()]
    return out


def assert_same_bookkeeping(actual, expected):
    assert len(actual) == len(expected) > 0
    for index, ((h_a, s_a), (h_e, s_e)) in enumerate(zip(actual, expected, strict=True)):
        assert_bitwise_equal(h_a, h_e, f"state {index}: amax history")
        assert_bitwise_equal(s_a, s_e, f"state {index}: scale")


# ---------------------------------------------------------------------------------------------
# 6. minifloat.checkpoint


@pytest.mark.parametrize("kind", list(RECIPES))
def test_checkpoint_equals_no_recompute(kind):
    recipe = RECIPES[kind]
    plain, expected = train_normally(kind)
    ckpt_block, ckpt = train(recipe, "checkpoint")
    assert_same(ckpt, plain, f"{kind} with recompute")
    if kind in DELAYED:
        assert_same_bookkeeping(delayed_bookkeeping(ckpt_block, recipe), expected)
        # the scales did move, so replaying the forward's scales mattered
        assert all(not torch.all(scale == 1) for _, scale in expected[::2])


def test_checkpoint_actually_recomputes(monkeypatch):
    """The checkpointed forward keeps no quantized activations: fc1 quantizes its input again
    in backward (and the result still equals the normal path, above)."""
    recipe = RECIPES["hybrid-mx-nv"]
    calls = []
    original = mf.Quantizer.__call__

    def spy(quantizer, x):
        calls.append(quantizer)
        return original(quantizer, x)

    monkeypatch.setattr(mf.Quantizer, "__call__", spy)
    block = Block()
    x = torch.randn(BATCH, IN, requires_grad=True)
    with mf.autocast(recipe=recipe):
        y = mf.checkpoint(block, x)
    fc1_input = block.fc1.quantizers(recipe)[0][0]
    assert isinstance(fc1_input, HybridQuantizer)
    assert sum(q is fc1_input for q in calls) == 1
    y.backward(torch.randn(BATCH, IN))
    assert sum(q is fc1_input for q in calls) == 2  # forward + recompute


@pytest.mark.parametrize("kind", ["delayed", "hybrid-delayed", "seed000"])
def test_checkpoint_of_a_function_that_enters_autocast(kind):
    recipe = RECIPES[kind]
    plain, expected = train_normally(kind)
    inside_block, inside = train(recipe, "autocast-inside")
    assert_same(inside, plain, f"{kind}, autocast inside the checkpoint")
    if kind in DELAYED:
        assert_same_bookkeeping(delayed_bookkeeping(inside_block, recipe), expected)


def test_checkpoint_rejects_reentrant_and_context_fn():
    block, x = Block(), torch.randn(BATCH, IN, requires_grad=True)
    with pytest.raises(ValueError, match="use_reentrant=False"), \
            mf.autocast(recipe=RECIPES["mxfp8"]):
        mf.checkpoint(block, x, use_reentrant=True)
    with pytest.raises(ValueError, match="context_fn"):
        mf.checkpoint(block, x, context_fn=lambda: None)


@pytest.mark.parametrize("kind", ["delayed", "mxfp8", "hybrid-mx-nv"])
def test_plain_torch_checkpoint_inside_autocast_is_not_silently_wrong(kind):
    """See the module docstring: torch's checkpoint recomputes outside the autocast."""
    block = Block()
    x = torch.randn(BATCH, IN, requires_grad=True)
    with mf.autocast(recipe=RECIPES[kind]):
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    mismatch = "different (metadata|number of tensors)"  # which one depends on the recipe
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match=mismatch):
        y.backward(torch.ones_like(y))
    x.grad = None
    with mf.autocast(recipe=RECIPES[kind]):
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                              determinism_check="none")
    with pytest.raises((RuntimeError, ValueError), match="size|dims|shape"):
        y.backward(torch.ones_like(y))


# ---------------------------------------------------------------------------------------------
# 7. CPU offload of saved tensors


class CopyingHooks:
    """saved_tensors_hooks that copy every saved tensor into a fresh buffer (as an offload to
    host memory would), poison the originals once the forward is done, and count."""

    def __init__(self):
        self.originals, self.unpacked = [], 0

    def pack(self, tensor):
        self.originals.append(tensor)
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buffer.copy_(tensor)
        return buffer

    def unpack(self, buffer):
        self.unpacked += 1
        return buffer

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def poison(self, keep):
        """Overwrite the saved originals (but not parameters): backward must use the copies."""
        keep = {t.data_ptr() for t in keep}
        for tensor in self.originals:
            if tensor.data_ptr() in keep:
                continue
            if tensor.is_floating_point() and tensor.element_size() > 1:
                tensor.fill_(float("nan"))
            else:
                tensor.view(torch.uint8).fill_(0x7F)


@pytest.mark.parametrize("kind", ["delayed", "nvfp4", "hybrid-mx-nv", "hybrid-delayed", "seed000"])
def test_save_on_cpu_equals_normal_path(kind):
    recipe = RECIPES[kind]
    plain, _ = train_normally(kind, steps=2)
    _, offloaded = train(recipe, steps=2, saved_hooks=torch.autograd.graph.save_on_cpu)
    assert_same(offloaded, plain, f"{kind} with save_on_cpu")


@pytest.mark.parametrize("kind", list(RECIPES))
def test_copying_saved_tensor_hooks_equal_normal_path(kind):
    recipe = RECIPES[kind]
    plain, _ = train_normally(kind, steps=1)
    torch.manual_seed(3)
    block = Block()
    x, dy = make_data(0)
    x.requires_grad_(True)
    hooks = CopyingHooks()
    torch.manual_seed(4)
    with hooks(), mf.autocast(recipe=recipe):
        y = block(x)
    hooks.poison(keep=[*block.parameters(), x])
    y.backward(dy)
    got = [y.detach(), x.grad, *(p.grad for p in (block.fc1.weight, block.fc1.bias,
                                                  block.fc2.weight, block.fc2.bias))]
    assert_same([got], plain, f"{kind} through copying hooks")
    assert hooks.unpacked == len(hooks.originals) > 0
    dtypes = {t.dtype for t in hooks.originals}
    assert dtypes & {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2}, dtypes


def test_hybrid_input_copy_travels_through_the_hooks():
    """The hybrid input's saved (columnwise, NVFP4 with RHT) copy is packed byte for byte."""
    recipe = RECIPES["hybrid-mx-nv"]
    torch.manual_seed(3)
    block = Block()
    x, dy = make_data(0)
    hooks = CopyingHooks()
    with hooks(), mf.autocast(recipe=recipe):
        y = block(x.requires_grad_(True))
    expected = numerics.quantize_nvfp4(x.detach(), rowwise=False, columnwise=True, with_rht=True)

    def packed(reference):
        return any(t.dtype == reference.dtype and t.shape == reference.shape
                   and torch.equal(t.view(torch.uint8), reference.view(torch.uint8))
                   for t in hooks.originals)

    assert packed(expected["columnwise_data"]) and expected["columnwise_data"].dtype == torch.uint8
    assert packed(expected["columnwise_scale"])
    assert expected["columnwise_scale"].dtype == torch.float8_e4m3fn
    # no MXFP8 rowwise (fprop) copy of the input and no high-precision input is saved
    rowwise = numerics.quantize_mxfp8(x.detach(), rowwise=True)["rowwise_data"]
    assert not packed(rowwise)
    assert not any(t.is_floating_point() and t.element_size() > 1 and t.shape == x.shape
                   for t in hooks.originals)
    y.backward(dy)
    assert hooks.unpacked == len(hooks.originals)


@pytest.mark.parametrize("kind", ["delayed", "hybrid-mx-nv", "seed000"])
def test_checkpoint_with_offload_hooks(kind):
    """Offload hooks around a checkpointed forward: recompute and offload compose."""
    plain, _ = train_normally(kind)
    _, both = train(RECIPES[kind], "checkpoint", saved_hooks=CopyingHooks())
    assert_same(both, plain, f"{kind}, checkpoint + copying hooks")

