"""FP8 current-scaling weight shards quantized together for FSDP2's all-gathers
(distributed/batched_weight_casts.py), over 2 gloo ranks.

test_fsdp2_low_precision shows that training with them equals the high-precision all-gather
bit for bit over AdamW steps (so a weight changed by a step is quantized again). Here: per
step, one batched cast of every weight (six: the Stack's modules and both experts) and one
all-reduce of their stacked amaxes, instead of a quantize call and an all-reduce per weight
and gather; forward's bytes serve backward's re-gathers; a weight changed in place between
steps is quantized again; a model of delayed-scaling weights is never batched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import minifloat as mf
import minifloat.distributed.batched_weight_casts as batched
import minifloat.distributed.fsdp as fsdp
from minifloat.distributed import enable_low_precision_all_gather

from .launch import cpu_randn, run_ranks
from .test_fsdp2_low_precision import HIDDEN, build, shard

STEPS = 2


def counting_worker(rank: int, world_size: int, recipe_name: str) -> dict:
    recipe = (mf.Float8CurrentScaling() if recipe_name == "current"
              else mf.DelayedScaling(amax_history_len=1))
    counts = {"batched": [], "alone": 0, "all_reduce": 0}
    quantize, format_inputs, all_reduce = (batched._quantize, fsdp.format_gather_inputs,
                                           dist.all_reduce)

    def counted_quantize(shards, *args):
        counts["batched"].append(len(shards))
        return quantize(shards, *args)

    def counted_format_inputs(*args, **kwargs):
        counts["alone"] += 1
        return format_inputs(*args, **kwargs)

    def counted_all_reduce(tensor, *args, **kwargs):
        counts["all_reduce"] += 1
        return all_reduce(tensor, *args, **kwargs)

    batched._quantize, fsdp.format_gather_inputs = counted_quantize, counted_format_inputs
    dist.all_reduce = counted_all_reduce
    model = build()
    enable_low_precision_all_gather(model, recipe)
    shard(model, world_size)
    # foreach (CUDA's default) updates the weights without bumping their version counters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = cpu_randn(world_size * 64, HIDDEN, generator=generator).chunk(world_size)[rank]
        with mf.autocast(recipe=recipe):  # no amax group: only the weights' reductions count
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # a weight changed in place (through the parameter, as load_state_dict does) is recast
    before = list(counts["batched"])
    with torch.no_grad():
        model[1].weight.mul_(2)
    with mf.autocast(recipe=recipe):
        model(x)
    return {**counts, "before_change": before}


def test_one_batched_cast_and_one_all_reduce_per_step():
    for result in run_ranks(counting_worker, 2, "current", timeout=180):
        # one batched cast of all six weights a step (forward and backward re-gathers reuse it)
        assert result["before_change"] == [6] * STEPS, result
        assert result["alone"] == 0
        # one all-reduce of the stacked amaxes a step (FSDP2's own collectives are no
        # all_reduce calls; before: one per weight and gather)
        assert result["all_reduce"] == STEPS + 1, result
        assert result["batched"] == [6] * (STEPS + 1)  # the changed weight: a new batch


def test_delayed_scaling_weights_are_quantized_alone():
    for result in run_ranks(counting_worker, 2, "delayed", timeout=180):
        assert result["batched"] == [] and result["alone"] > 0


def freed_worker(rank: int, world_size: int) -> dict:
    """Whether a sharded model of batched weights is freed once its user drops it."""
    import gc
    import weakref

    recipe = mf.Float8CurrentScaling()
    model = build()
    enable_low_precision_all_gather(model, recipe)
    shard(model, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x = cpu_randn(64, HIDDEN, generator=torch.Generator().manual_seed(rank))
    with mf.autocast(recipe=recipe):
        model(x).float().pow(2).mean().backward()
    optimizer.step()
    batched_weights = sum(isinstance(getattr(p, "_local_tensor", p), fsdp.LowPrecisionGatherWeight)
                          and getattr(p, "_local_tensor", p)._batch is not None
                          for p in model.parameters())
    model_ref = weakref.ref(model)
    del model, optimizer
    gc.collect()
    return {"batched_weights": batched_weights, "alive": model_ref() is not None}


def test_a_dropped_model_is_freed():
    """Every wrapped shard holds the batch; the batch must not hold the modules strongly: FSDP2's
    parameters hide their attributes from Python's collector, and such a cycle kept whole
    models (1.5 GiB a rank at 1b) alive after their last use (the twenty-first session)."""
    for result in run_ranks(freed_worker, 2, timeout=180):
        assert result["batched_weights"] == 6
        assert not result["alive"]
