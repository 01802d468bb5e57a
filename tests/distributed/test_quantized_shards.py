"""quantized_model_init weights under FSDP2 (distributed/quantized_shards.py): the FP8 bytes are
sharded and all-gathered as they are, and quantize_master_weights casts each rank's fp32 master
rows into its own shard, with the amax all-reduced over the group.

Two gloo ranks train against one process that runs the same two halves of each batch as
micro-batches (summing their gradients and halving them, what FSDP2's reduce-scatter computes for
two ranks, exactly) and casts its full masters. Activations and gradients are quantized per rank
in both, the gathered weight is the full weight's bytes in both, and each master row gets the
same update: losses, masters, FP8 bytes and scales must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minifloat as mf
from minifloat.distributed import (
    enable_low_precision_all_gather,
    post_all_gather_processing,
    quantize_master_weights,
)

from .launch import run_ranks

WORLD, HIDDEN, ROWS, STEPS = 2, 64, 32, 3
RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "delayed": lambda: mf.DelayedScaling(amax_history_len=1),
}


def build(recipe) -> tuple[nn.Module, list[torch.Tensor]]:
    """Two FP8-weight Linears and the fp32 masters of their weights (the initial values)."""
    torch.manual_seed(0)
    with mf.quantized_model_init(recipe=recipe, keep_high_precision_copy=True):
        model = nn.Sequential(mf.Linear(HIDDEN, HIDDEN, bias=False, name="a"),
                              mf.Linear(HIDDEN, HIDDEN, bias=False, name="b"))
    return model, [layer.weight_hp_init.float() for layer in model]


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(WORLD * ROWS, HIDDEN, generator=generator) for _ in range(STEPS)]


def sharded_worker(rank: int, world_size: int, name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    recipe = RECIPES[name]()
    model, full_masters = build(recipe)
    enable_low_precision_all_gather(model, recipe)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rows = HIDDEN // world_size
    masters = [m[rank * rows:(rank + 1) * rows].reshape(-1).clone() for m in full_masters]
    starts = [rank * rows * HIDDEN] * len(masters)
    params = [layer.weight for layer in model]
    optimizer = torch.optim.SGD(masters, lr=0.5)
    losses = []
    for x in batches():
        with mf.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = model(x.chunk(world_size)[rank]).float().pow(2).mean()
        loss.backward()
        for master, param in zip(masters, params, strict=True):
            master.grad = param.grad.to_local().float().reshape(-1)
            param.grad = None
        optimizer.step()
        quantize_master_weights(params, masters, starts, group=dist.group.WORLD)
        losses.append(loss.detach().clone())
    mf.update_delayed_backward_scales()
    shards = [param.to_local() for param in params]
    return {"losses": losses, "masters": masters,
            "bytes": [shard._data.clone() for shard in shards],
            "scales": [shard._scale_inv.clone() for shard in shards]}


def reference(name: str) -> dict:
    recipe = RECIPES[name]()
    model, masters = build(recipe)
    masters = [m.reshape(-1).clone() for m in masters]
    optimizer = torch.optim.SGD(masters, lr=0.5)
    losses = [[] for _ in range(WORLD)]
    for x in batches():
        with mf.autocast(recipe=recipe):
            for rank, piece in enumerate(x.chunk(WORLD)):
                loss = model(piece).float().pow(2).mean()
                loss.backward()
                losses[rank].append(loss.detach())
        for master, layer in zip(masters, model, strict=True):
            master.grad = (layer.weight.grad / WORLD).float().reshape(-1)
            layer.weight.grad = None
        optimizer.step()
        weights = [layer.weight for layer in model]
        quantize_master_weights(weights, masters, [0, 0])
        post_all_gather_processing(weights)  # the transposed copies dgrad reads
    mf.update_delayed_backward_scales()
    storages = [layer.weight.quantized_storage for layer in model]
    return {"losses": losses, "masters": masters,
            "bytes": [s.data.view(torch.uint8) for s in storages],
            "scales": [s.scale_inv for s in storages]}


@pytest.mark.parametrize("name", list(RECIPES))
def test_sharded_fp8_weights_train_like_one_process_bitwise(name):
    want = reference(name)
    rows = HIDDEN // WORLD
    for rank, got in enumerate(run_ranks(sharded_worker, WORLD, name, timeout=120)):
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"][rank], strict=True)):
            assert torch.equal(a, b), f"{name} rank {rank} step {step} loss"
        for index in range(2):
            mine = slice(rank * rows * HIDDEN, (rank + 1) * rows * HIDDEN)
            assert torch.equal(got["masters"][index], want["masters"][index][mine])
            assert torch.equal(got["bytes"][index],
                               want["bytes"][index][rank * rows:(rank + 1) * rows])
            assert torch.equal(got["scales"][index], want["scales"][index])


def test_other_quantized_formats_are_refused_clearly():
    with mf.quantized_model_init(recipe=mf.MXFP8BlockScaling()):
        model = nn.Sequential(mf.Linear(HIDDEN, HIDDEN, name="mx"))
    with pytest.raises(NotImplementedError, match="per-tensor FP8"):
        enable_low_precision_all_gather(model, mf.MXFP8BlockScaling())


def test_the_bytes_refuse_arithmetic():
    """An optimizer step on the sharded bytes would be meaningless: it must go through the
    masters, and says so."""
    from minifloat.distributed.quantized_shards import QuantizedShardWeight

    with mf.quantized_model_init(recipe=mf.Float8CurrentScaling()):
        layer = mf.Linear(HIDDEN, HIDDEN)
    shard = QuantizedShardWeight.of(layer.weight)
    with pytest.raises(NotImplementedError, match="quantize_master_weights"):
        shard.add_(1.0)
    assert torch.equal(shard.narrow(0, 0, 8)._data, shard._data[:8])
