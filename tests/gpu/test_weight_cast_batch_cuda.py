"""The eager batched weight cast on CUDA (modules/weight_cast_batch.py): the multi-tensor kernels
with one allocation per copy (current and delayed scaling) against the single-tensor casts, bit
for bit, and training with the batch against training without it, bit for bit."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
from minifloat.kernels import multi_tensor_each, per_tensor_fp8
from minifloat.modules import weight_cast_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(2048, 2048), (48, 80), (1, 16), (100, 36), (8192, 2048), (16, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("epsilon,pow2", [(0.0, False), (1e-3, True)])
def test_each_copy_in_its_own_allocation_has_the_single_cast_bytes(dtype, fp8_dtype, epsilon,
                                                                   pow2):
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(shape, device="cuda", generator=g, dtype=torch.float32).mul_(
        10.0 ** (i - 2)).to(dtype) for i, shape in enumerate(SHAPES)]
    tensors[1].zero_()  # an all-zero tensor: amax 0
    results = multi_tensor_each.quantize_current_scaling_each(
        tensors, fp8_dtype, amax_epsilon=epsilon, power_2_scale=pow2)
    storages = set()
    for x, (data, data_t, scale_inv) in zip(tensors, results, strict=True):
        want_data, want_t, want_scale_inv = per_tensor_fp8.quantize_current_scaling(
            x, fp8_dtype, amax_epsilon=epsilon, power_2_scale=pow2)
        assert data.shape == want_data.shape and data_t.shape == want_t.shape
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(data_t.view(torch.uint8), want_t.view(torch.uint8))
        assert torch.equal(scale_inv, want_scale_inv)
        assert scale_inv.data_ptr() % 16 == 0  # cuBLAS's FP8 GEMM wants it aligned
        storages.update((data.untyped_storage().data_ptr(), data_t.untyped_storage().data_ptr()))
    assert len(storages) == 2 * len(tensors), "each copy is its own allocation"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_delayed_scaling_each_has_the_single_cast_bytes_and_amaxes(dtype, fp8_dtype):
    """One launch, each tensor with its own scale and amax slot, the slots in two separate
    state tensors (as two modules' recipe states): the bytes, scale_inv and folded amaxes of
    per_tensor_fp8.quantize_delayed_scaling on each tensor."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(shape, device="cuda", generator=g, dtype=torch.float32).mul_(
        10.0 ** (i - 2)).to(dtype) for i, shape in enumerate(SHAPES)]
    tensors[1].zero_()
    n = len(tensors)
    scales = torch.rand(n, device="cuda", generator=g) * 100 + 0.5  # one state tensor
    amaxes = torch.rand(3, n, device="cuda", generator=g)  # another: row 0 is folded into
    want_amaxes, before = amaxes.clone(), amaxes.clone()
    results = multi_tensor_each.quantize_delayed_scaling_each(
        tensors, fp8_dtype, [scales[i:i + 1] for i in range(n)],
        [amaxes[0, i:i + 1] for i in range(n)])
    for i, (x, (data, data_t, scale_inv)) in enumerate(zip(tensors, results, strict=True)):
        want_data, want_t, want_scale_inv = per_tensor_fp8.quantize_delayed_scaling(
            x, scales[i:i + 1], want_amaxes[0, i:i + 1], fp8_dtype)
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(data_t.view(torch.uint8), want_t.view(torch.uint8))
        assert torch.equal(scale_inv, want_scale_inv)
        assert scale_inv.data_ptr() % 16 == 0
    assert torch.equal(amaxes, want_amaxes)
    assert not torch.equal(amaxes[0], before[0]), "the amaxes were folded in"
    assert torch.equal(amaxes[1:], before[1:]), "only the given slots are written"


def train(recipe, batched: bool, fused: bool, steps: int = 4):
    weight_cast_batch.ENABLED = batched
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(mf.Linear(256, 512), torch.nn.GELU(), mf.Linear(512, 256),
                                  mf.LayerNormMLP(256, 1024, normalization="RMSNorm")).cuda()
        net = net.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused)
        g = torch.Generator(device="cuda").manual_seed(1)
        before = weight_cast_batch.batches_run()
        losses = []
        for _ in range(steps):
            x = torch.randn(4, 64, 256, device="cuda", generator=g, dtype=torch.bfloat16)
            with mf.autocast(recipe=recipe):
                loss = net(x).float().square().mean()
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        held = sum(len(batch.copies) for batch in weight_cast_batch._BATCHES.values())
        return losses, [p.detach().clone() for p in net.parameters()], (
            weight_cast_batch.batches_run() - before), held
    finally:
        weight_cast_batch.ENABLED = True


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("recipe", [mf.Float8CurrentScaling(),
                                    mf.Float8CurrentScaling(fp8_format=mf.Format.E4M3),
                                    mf.DelayedScaling(amax_history_len=4)])
def test_training_with_the_batch_equals_training_without(recipe, fused):
    losses, params, batches, held = train(recipe, batched=True, fused=fused)
    ref_losses, ref_params, ref_batches, _ = train(recipe, batched=False, fused=fused)
    assert batches == 3 and ref_batches == 0  # steps 2-4: one batch each
    for a, b in zip(losses + params, ref_losses + ref_params, strict=True):
        assert torch.equal(a, b)
    assert held == 0, "every copy was taken by its forward: the batch keeps none"
