"""A plain-PyTorch GPT: the honest baseline for minifloat's end-to-end speed claims.

Why it exists: a speed-up measured against minifloat's own modules run without a recipe says
nothing about what a user gains over the PyTorch they would write anyway. This model is built
from torch.nn alone (nn.Embedding, nn.RMSNorm, bias-free nn.Linear for every projection and for
the LM head, F.gelu with the tanh approximation or F.silu for SwiGLU, and
F.scaled_dot_product_attention with is_causal=True) and imports nothing from minifloat, so the
same module tree is

- the bf16 baseline, eager or under torch.compile;
- the input of torchao's convert_to_float8_training;
- the input of minifloat.convert_model, which swaps its nn.Linear layers for minifloat.Linear.

Every model keeps its LM head in `model.head` so conversions can leave it in bf16, e.g.
`convert_model(model, recipe, filter_fn=not_head)`.

Layer names follow minifloat.models.gpt (blocks.{i}.attn.qkv, blocks.{i}.attn.proj,
blocks.{i}.mlp.fc1, blocks.{i}.mlp.fc2, head), so HybridRecipe globs written for the lab GPT
select the same GEMMs here. The SwiGLU MLP names its layers blocks.{i}.mlp.gate, .up and .down.
Unlike the lab GPT, the RMSNorms are modules of the block (attn_norm, mlp_norm) rather than
fused into the next projection: that is what plain PyTorch code looks like.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import PRESETS as LAB_PRESETS
from .gpt import CausalLM, causal_attention  # code only: the layers here are torch.nn's

VOCAB_SIZE = 256  # bytes, as in minifloat.models.gpt
NORM_EPS = 1e-5  # minifloat's LayerNormLinear/LayerNormMLP default, and Llama's


@dataclass(frozen=True)
class TorchGPTConfig:
    """Model and batch shape; batch_size x seq_len tokens per training step.

    mlp: "gelu" (fc1 -> GELU(tanh) -> fc2, GPT-2 style) or "swiglu" (down(silu(gate(x)) * up(x)),
    Llama style). The vocabulary stays 256 bytes in every preset: the head is kept in bf16 in
    every benchmark row, so a large vocabulary would add the same time to every row and only
    dilute the ratios of the blocks' GEMMs that the recipes change.
    """

    n_layers: int
    d_model: int
    n_heads: int
    ffn_hidden: int
    seq_len: int
    batch_size: int
    mlp: str = "gelu"
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must divide into n_heads={self.n_heads}")
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def linears_per_block(self) -> int:
        """nn.Linear layers in one block: qkv, proj and the MLP's two (gelu) or three."""
        return 2 + (3 if self.mlp == "swiglu" else 2)

    def parameter_count(self) -> int:
        mlp = (3 if self.mlp == "swiglu" else 2) * self.d_model * self.ffn_hidden
        per_block = 4 * self.d_model ** 2 + mlp + 2 * self.d_model  # + two RMSNorm gains
        embeddings = (self.vocab_size + self.seq_len) * self.d_model
        return (self.n_layers * per_block + embeddings + self.d_model
                + self.vocab_size * self.d_model)


def _like_lab(name: str) -> TorchGPTConfig:
    """The lab GPT's preset of that name (same shapes, so the two models compare directly)."""
    lab = LAB_PRESETS[name]
    return TorchGPTConfig(n_layers=lab.n_layers, d_model=lab.d_model, n_heads=lab.n_heads,
                          ffn_hidden=lab.ffn_hidden, seq_len=lab.seq_len,
                          batch_size=lab.batch_size)


PRESETS: dict[str, TorchGPTConfig] = {
    # tiny: CPU tests, ~0.5M parameters; small: ~25M, launch-bound on a GPU; 1b: ~1.0e9
    **{name: _like_lab(name) for name in ("tiny", "small", "1b")},
    # Two blocks at Llama-3-8B width (d 4096, SwiGLU 14336, 32 heads of 128; full multi-head
    # attention and learned positions, no GQA/RoPE, which change no GEMM the recipes touch much).
    # Batch 8 x 2048 = 16384 tokens, so the block GEMMs are linear_step.py's 16384-row shapes.
    # ~0.49e9 parameters: bf16 weights, grads and AdamW states take ~4 GB and the saved
    # activations ~6 GB, so bf16 with AdamW fits one 80 GB H100 with room for the quantized
    # recipes' extra copies.
    "llama-block": TorchGPTConfig(n_layers=2, d_model=4096, n_heads=32, ffn_hidden=14336,
                                  seq_len=2048, batch_size=8, mlp="swiglu"),
    # 32 such blocks: the Llama-3-8B shape (~7.8e9 parameters), 2 x 2048 tokens a step. Its bf16
    # weights, grads and AdamW states take ~62 GB, plus ~24 GB of saved activations: more than
    # one 80 GB H100 holds, so it trains there only sharded (benchmarks/scale_step.py).
    "8b": TorchGPTConfig(n_layers=32, d_model=4096, n_heads=32, ffn_hidden=14336, seq_len=2048,
                         batch_size=2, mlp="swiglu"),
}


class Attention(nn.Module):
    """Causal self-attention: one fused QKV projection, SDPA (flash on GPUs), output projection."""

    def __init__(self, config: TorchGPTConfig, dtype: torch.dtype | None,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False, dtype=dtype,
                             device=device)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False, dtype=dtype,
                              device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(causal_attention(self.qkv(x), self.n_heads))


class GeluMLP(nn.Module):
    """fc1 -> GELU (tanh approximation, as minifloat's LayerNormMLP "gelu") -> fc2."""

    def __init__(self, config: TorchGPTConfig, dtype: torch.dtype | None,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False, dtype=dtype,
                             device=device)
        self.fc2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False, dtype=dtype,
                             device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLUMLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), three separate bias-free projections."""

    def __init__(self, config: TorchGPTConfig, dtype: torch.dtype | None,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.ffn_hidden, bias=False, dtype=dtype,
                              device=device)
        self.up = nn.Linear(config.d_model, config.ffn_hidden, bias=False, dtype=dtype,
                            device=device)
        self.down = nn.Linear(config.ffn_hidden, config.d_model, bias=False, dtype=dtype,
                              device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TorchGPTConfig, dtype: torch.dtype | None,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=NORM_EPS, dtype=dtype, device=device)
        self.attn = Attention(config, dtype, device)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=NORM_EPS, dtype=dtype, device=device)
        mlp = SwiGLUMLP if config.mlp == "swiglu" else GeluMLP
        self.mlp = mlp(config, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TorchGPT(CausalLM):
    """Byte-level decoder from torch.nn alone: tokens [B, T] -> logits [B, T, vocab_size]."""

    def __init__(self, config: TorchGPTConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype,
                                            device=device)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model, dtype=dtype,
                                               device=device)
        self.blocks = nn.ModuleList(Block(config, dtype, device) for _ in range(config.n_layers))
        self.final_norm = nn.RMSNorm(config.d_model, eps=NORM_EPS, dtype=dtype, device=device)
        # The LM head: callers keep it out of FP8 conversion (see not_head).
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, dtype=dtype,
                              device=device)
        for embedding in (self.token_embedding, self.position_embedding):
            nn.init.normal_(embedding.weight, std=0.02)

    @classmethod
    def from_preset(cls, name: str, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> TorchGPT:
        """The model of PRESETS[name]; a KeyError lists the preset names."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        return cls(PRESETS[name], dtype=dtype, device=device)


def not_head(name: str, module: nn.Module) -> bool:
    """filter_fn for minifloat.convert_model: every nn.Linear but the LM head is converted.

    Why keep the head out: its output feeds a softmax over the vocabulary, the most
    precision-sensitive GEMM of the model, and FP8 recipes in practice leave it in bf16."""
    return name != "head"


__all__ = ["PRESETS", "VOCAB_SIZE", "TorchGPT", "TorchGPTConfig", "not_head"]
