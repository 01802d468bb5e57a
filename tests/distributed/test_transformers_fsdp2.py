"""A Hugging Face model a user brings (transformers' Llama from a small config), converted
with convert_model and sharded with FSDP2 (fully_shard per decoder layer, then the root), trains
on 2 gloo ranks under FP8 current scaling as one process does on the same two halves of each
batch, bit for bit, with the high-precision all-gather and with the FP8 all-gather."""

from __future__ import annotations

import pytest
import torch

import minifloat as mf

from .launch import device_mesh, run_ranks

pytest.importorskip("transformers")
STEPS = 3


def build() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    mf.convert_model(model, recipe=mf.Float8CurrentScaling(),
                     filter_fn=lambda name, _: name != "lm_head")
    return model


def batch(step: int) -> torch.Tensor:
    """The step's tokens, drawn on the CPU (the same on every backend), on the default device
    (cuda:rank under NCCL, where the model is)."""
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step),
                           device="cpu")
    return tokens.to(torch.get_default_device())


def sharded_worker(rank: int, world_size: int, low_precision: bool) -> list[torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from minifloat.distributed import enable_low_precision_all_gather

    model, recipe = build(), mf.Float8CurrentScaling()
    if low_precision:
        enable_low_precision_all_gather(model, recipe)
    mesh = device_mesh((world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        tokens = batch(step).chunk(world_size)[rank].to(torch.get_default_device())
        with mf.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def one_process() -> list[list[torch.Tensor]]:
    """Both halves of each batch as micro-batches, each gradient halved (exact: a power of
    two), then one step: what FSDP2's reduce-scatter over 2 ranks computes."""
    model, recipe = build(), mf.Float8CurrentScaling()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [[], []]
    for step in range(STEPS):
        with mf.autocast(recipe=recipe):
            for rank, tokens in enumerate(batch(step).chunk(2)):
                tokens = tokens.to(torch.get_default_device())
                loss = model(input_ids=tokens, labels=tokens).loss
                (loss / 2).backward()
                losses[rank].append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("low_precision", [False, True], ids=["bf16-gather", "fp8-gather"])
def test_converted_llama_trains_under_fsdp2_like_one_process(low_precision):
    want = one_process()
    for rank, got in enumerate(run_ranks(sharded_worker, 2, low_precision, timeout=180)):
        for step, (a, b) in enumerate(zip(got, want[rank], strict=True)):
            assert torch.equal(a, b), f"rank {rank} step {step}: {a.item()} != {b.item()}"
