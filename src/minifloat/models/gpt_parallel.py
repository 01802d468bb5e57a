"""The lab GPT under tensor parallelism, started from a one-rank model's weights (issue 17).

`tensor_parallel_gpt(full, tp_group)` builds the GPT with its blocks split over the group and
copies into every rank's modules its slice of `full`'s weights, so that a TP run and a one-rank
run start from the same model:

- qkv (column-parallel): rank r's rows are q, k and v of its heads, [q_r | k_r | v_r], the layout
  causal_attention reads with n_heads / tp heads;
- proj (row-parallel): the input features of rank r's heads;
- MLP fc1 (column-parallel): rank r's slice of the features (of each half, when gated); fc2
  (row-parallel): the matching input features;
- norms, embeddings, the final norm and the head: whole, on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .gpt import GPT


def tensor_parallel_gpt(full: GPT, tp_group: Any) -> GPT:
    rank, size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    config = full.config
    parameter = next(full.parameters())
    model = GPT(config, dtype=parameter.dtype, device=parameter.device, tp_group=tp_group)

    def part(count: int) -> slice:
        return slice(rank * count // size, (rank + 1) * count // size)

    d, ffn = config.d_model, config.ffn_hidden
    halves = 2 if config.activation in ("swiglu", "geglu") else 1
    with torch.no_grad():
        for name in ("token_embedding", "position_embedding", "final_norm", "head"):
            getattr(model, name).load_state_dict(getattr(full, name).state_dict())
        for mine, whole in zip(model.blocks, full.blocks, strict=True):
            mine.attn.qkv.layer_norm_weight.copy_(whole.attn.qkv.layer_norm_weight)
            mine.attn.qkv.weight.copy_(torch.cat([w[part(d)] for w in
                                                  whole.attn.qkv.weight.split(d)]))
            mine.attn.proj.weight.copy_(whole.attn.proj.weight[:, part(d)])
            mine.mlp.layer_norm_weight.copy_(whole.mlp.layer_norm_weight)
            mine.mlp.fc1_weight.copy_(torch.cat([w[part(ffn)] for w in
                                                 whole.mlp.fc1_weight.chunk(halves)]))
            mine.mlp.fc2_weight.copy_(whole.mlp.fc2_weight[:, part(ffn)])
    return model
