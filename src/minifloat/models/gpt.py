"""A small byte-level GPT whose GEMMs are minifloat modules, for recipe comparisons.

Every projection and MLP is a minifloat module (LayerNormLinear for the normed QKV projection,
Linear for the attention output and the LM head, LayerNormMLP for the MLP), so a recipe reaches
every GEMM of the model. The token and position embeddings, the final RMSNorm and the attention
itself (torch's scaled_dot_product_attention, causal) run in high precision, as they do in FP8
training elsewhere.

Layer names are the roles' names: blocks.{i}.attn.qkv, blocks.{i}.attn.proj,
blocks.{i}.mlp.fc1, blocks.{i}.mlp.fc2 and head, so a HybridRecipe's high_precision=("blocks.11.*",
"head") keeps the last block and the head in high precision.

Every dimension of the presets is a multiple of 128 and the token count of a batch
(batch x seq_len) too, so every recipe's blocks (32, 16, 128 and 128x128) tile every GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import LayerNormLinear, LayerNormMLP, Linear

VOCAB_SIZE = 256  # bytes
BLOCK_MULTIPLE = 128


@dataclass(frozen=True)
class GPTConfig:
    """Model and batch shape. batch_size x seq_len tokens per step."""

    n_layers: int
    d_model: int
    n_heads: int
    ffn_hidden: int
    seq_len: int
    batch_size: int
    activation: str = "gelu"

    def __post_init__(self) -> None:
        for field in ("d_model", "ffn_hidden"):
            value = getattr(self, field)
            if value % BLOCK_MULTIPLE:
                raise ValueError(f"GPTConfig.{field}={value} must be a multiple of "
                                 f"{BLOCK_MULTIPLE} so every recipe's blocks tile the GEMMs")
        if (self.batch_size * self.seq_len) % BLOCK_MULTIPLE:
            raise ValueError(f"batch_size x seq_len = {self.batch_size * self.seq_len} must be a "
                             f"multiple of {BLOCK_MULTIPLE} (the GEMMs' row count)")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must divide into n_heads={self.n_heads}")
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def parameter_count(self) -> int:
        gated = self.activation in ("swiglu", "geglu")
        per_block = 4 * self.d_model ** 2 + (3 if gated else 2) * self.d_model * self.ffn_hidden
        embeddings = (VOCAB_SIZE + self.seq_len) * self.d_model
        return self.n_layers * per_block + embeddings + VOCAB_SIZE * self.d_model


PRESETS: dict[str, GPTConfig] = {
    # a CPU run of minutes: ~0.5M parameters, 1024 tokens a step
    "tiny": GPTConfig(n_layers=2, d_model=128, n_heads=4, ffn_hidden=512, seq_len=128,
                      batch_size=8),
    # ~25M parameters: a GPU run of minutes
    "small": GPTConfig(n_layers=8, d_model=512, n_heads=8, ffn_hidden=2048, seq_len=512,
                       batch_size=16),
    # 1B class (about 1.0e9 parameters): one H100/H200
    "1b": GPTConfig(n_layers=20, d_model=2048, n_heads=16, ffn_hidden=8192, seq_len=2048,
                    batch_size=4),
}


def causal_attention(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal multi-head SDPA over a fused q|k|v projection [B, T, 3d] -> [B, T, d] (shared by
    the lab GPT and the plain-PyTorch GPT)."""
    batch, seq, width = qkv.shape
    d_model = width // 3
    heads = [t.reshape(batch, seq, n_heads, d_model // n_heads).transpose(1, 2)
             for t in qkv.split(d_model, dim=-1)]
    attended = F.scaled_dot_product_attention(*heads, is_causal=True)
    return attended.transpose(1, 2).reshape(batch, seq, d_model)


class Attention(nn.Module):
    """Pre-norm causal self-attention: RMSNorm + QKV in one LayerNormLinear, SDPA, projection.

    Under tensor parallelism (`tp_group`) the heads are split: qkv is column-parallel, each
    rank's output [q | k | v] of its own heads (models/gpt_parallel.py lays the weights out so),
    and proj row-parallel."""

    def __init__(self, config: GPTConfig, name: str, dtype: torch.dtype | None,
                 device: torch.device | str | None, tp_group: Any = None) -> None:
        super().__init__()
        tp = {} if tp_group is None else {"tp_group": tp_group}
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        if config.n_heads % tp_size:
            raise ValueError(f"n_heads={config.n_heads} does not split over {tp_size} ranks")
        self.n_heads = config.n_heads // tp_size
        self.qkv = LayerNormLinear(config.d_model, 3 * config.d_model, bias=False,
                                   normalization="RMSNorm", params_dtype=dtype, device=device,
                                   name=f"{name}.qkv",
                                   parallel_mode="column" if tp else None, **tp)
        self.proj = Linear(config.d_model, config.d_model, bias=False, params_dtype=dtype,
                           device=device, name=f"{name}.proj",
                           parallel_mode="row" if tp else None, **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(causal_attention(self.qkv(x), self.n_heads))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, index: int, dtype: torch.dtype | None,
                 device: torch.device | str | None, tp_group: Any = None) -> None:
        super().__init__()
        name = f"blocks.{index}"
        self.attn = Attention(config, f"{name}.attn", dtype, device, tp_group)
        tp = {} if tp_group is None else {"tp_group": tp_group, "set_parallel_mode": True}
        self.mlp = LayerNormMLP(config.d_model, config.ffn_hidden, bias=False,
                                normalization="RMSNorm", activation=config.activation,
                                params_dtype=dtype, device=device, name=f"{name}.mlp", **tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class CausalLM(nn.Module):
    """forward and loss of a decoder over token ids, shared by the lab GPT and the plain-PyTorch
    GPT (models.torch_gpt) so that both compute the same thing the same way. A subclass sets
    config (seq_len), token_embedding, position_embedding, blocks, final_norm and head."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len "
                             f"{self.config.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy over tokens [B, T+1] (inputs [:, :-1], targets [:, 1:]);
        the logits go to fp32 first."""
        logits = self.forward(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))


class GPT(CausalLM):
    """Byte-level decoder: tokens [B, T] (uint8 values as int64) -> logits [B, T, 256]."""

    def __init__(self, config: GPTConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp_group: Any = None) -> None:
        """`tp_group`: tensor parallelism over the blocks (heads and MLP features split);
        the embeddings, the final norm and the head stay whole on every rank. Build it from a
        one-rank model with models.gpt_parallel.tensor_parallel_gpt to start from its
        weights."""
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(VOCAB_SIZE, config.d_model, dtype=dtype,
                                            device=device)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model, dtype=dtype,
                                               device=device)
        self.blocks = nn.ModuleList(Block(config, i, dtype, device, tp_group)
                                    for i in range(config.n_layers))
        self.final_norm = nn.RMSNorm(config.d_model, dtype=dtype, device=device)
        self.head = Linear(config.d_model, VOCAB_SIZE, bias=False, params_dtype=dtype,
                           device=device, name="head")
        self._init_embeddings()

    def _init_embeddings(self) -> None:
        for embedding in (self.token_embedding, self.position_embedding):
            nn.init.normal_(embedding.weight, std=0.02)

