"""quantize_master_weights' batched FP8 current-scaling cast (distributed/master_cast_batched.py:
multi-tensor amax and cast launches, foreach copies) equals the per-weight reference cast bit
for bit: bytes in every rank's range, scale_inv, bytes outside the range untouched; with a
NaN in one master, an empty range (master None) and bf16 masters beside fp32 ones."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf
import minifloat.distributed.master_cast_batched as batched_module
from minifloat import kernels
from minifloat.distributed import quantize_master_weights

DEVICE = kernels.kernel_device()
if DEVICE is None:
    pytest.skip("needs CUDA with Triton", allow_module_level=True)

SHAPES = [(64, 96), (128, 256), (32, 64), (48, 80)]


def weights_and_masters(seed: int) -> tuple[list[torch.Tensor], list, list[int]]:
    torch.manual_seed(seed)
    with mf.quantized_model_init(recipe=mf.Float8CurrentScaling()):
        layers = [mf.Linear(k, n, bias=False, device=DEVICE) for n, k in SHAPES]
    generator = torch.Generator().manual_seed(seed)
    masters, starts = [], []
    for index, (n, k) in enumerate(SHAPES):
        full = torch.randn(n * k, generator=generator) * (index + 1)
        start, end = (n * k) // 3, (2 * n * k) // 3 + 5  # a range that cuts rows
        master = full[start:end].clone()
        if index == 1:
            master[7] = float("nan")
        if index == 2:
            master = master.to(torch.bfloat16)
        masters.append(None if index == 3 else master.to(DEVICE))
        starts.append(start)
    return [layer.weight for layer in layers], masters, starts


def snapshot(weights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(w.quantized_storage.data.view(torch.uint8).clone(),
             w.quantized_storage.scale_inv.clone()) for w in weights]


def test_batched_cast_equals_the_reference(monkeypatch):
    calls = []
    original = batched_module.cast_current_scaling
    monkeypatch.setattr(batched_module, "cast_current_scaling",
                        lambda casts, group: calls.append(len(casts)) or original(casts, group))
    import minifloat.distributed.master_weights as master_weights

    monkeypatch.setattr(master_weights, "cast_current_scaling",
                        batched_module.cast_current_scaling)
    weights, masters, starts = weights_and_masters(0)
    quantize_master_weights(weights, masters, starts)
    got = snapshot(weights)
    assert calls == [4]  # the batched path ran, for all four weights

    monkeypatch.setenv("MINIFLOAT_DISABLE_KERNELS", "1")  # the per-weight reference
    weights, masters, starts = weights_and_masters(0)
    quantize_master_weights(weights, masters, starts)
    want = snapshot(weights)
    assert calls == [4]
    for index, ((data, scale_inv), (want_data, want_scale_inv)) in enumerate(
            zip(got, want, strict=True)):
        assert torch.equal(data, want_data), index
        assert torch.equal(scale_inv, want_scale_inv) or (
            torch.isnan(scale_inv).all() and torch.isnan(want_scale_inv).all()), index
