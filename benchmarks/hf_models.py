"""Hugging Face transformers models built from configs, as model_step.py rows train them
(issue 21's benchmark: what a user who brings a transformers model gets).

Why a wrapper: model_step.py trains anything with a `loss(tokens)` method on token batches
[batch, seq+1]; `HFCausalLM.loss` runs the transformers model on tokens[:, :-1] and takes the
cross-entropy against tokens[:, 1:], as TorchGPT.loss does. The transformers model is the
wrapper's child `hf`, so its LM head is `hf.lm_head` (kept in bf16 by every row, as the GPT's).

Presets (the batch shape of a step included):
  hf-llama-1b       Llama 3.2 1B's shapes: 16 layers, d 2048, SwiGLU 8192, 32 heads over 8 KV
                    heads, vocabulary 128256, tied embeddings (1.24e9 parameters); 4 x 2048
  hf-mixtral-moe    Mixtral-style: 8 layers, d 2048, 8 experts of SwiGLU 4096, top-2, 32 heads
                    over 8 KV heads, vocabulary 32000 (1.8e9 parameters); 4 x 2048
  hf-mixtral-8x7b-2l Mixtral 8x7B's layer shapes, 2 layers: d 4096, 8 experts of SwiGLU 14336,
                    top-2, 32 heads over 8 KV heads, vocabulary 32000 (3.1e9 parameters);
                    4 x 2048 tokens (hf-mixtral-moe's experts are narrow: their GEMMs took a
                    quarter of its bf16 step's GPU time on an H100)
  hf-llama-tiny, hf-mixtral-tiny    CPU smoke tests
  hf-llama-1b-causal, hf-mixtral-moe-causal, hf-mixtral-8x7b-2l-causal, hf-llama-tiny-causal
                    the same models with attention run as SDPA's causal kernel (is_causal,
                    grouped KV heads in the kernel) instead of over a materialised mask

Why the -causal presets: transformers 5.24 lets SDPA take `is_causal` (flash attention) when no
token is padded, except while dynamo traces on torch older than 2.14 (masking_utils.
_ignore_causal_mask_sdpa: dynamo answered "exporting" before pytorch#176499). By that rule,
on the GPU machine's torch 2.11 every compiled row runs attention over a [seq, seq] boolean mask
with the KV heads repeated (repeat_kv), eager rows over the causal kernel. The -causal presets
register transformers' own `sdpa_attention_forward` under a name that has no mask function, so
no mask is built in either mode and the same function takes `is_causal`. It is a benchmark
setting for unpadded batches only: a padding mask would be dropped, which is why the library
does not do this for users.

On the GPU machine (no network, no transformers) transformers and its dependencies travel as
wheels in .whl/hf (git-ignored; carry .whl), made here with `pip download transformers==5.24.0
-d .whl/hf --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64
--platform manylinux2014_x86_64 --platform any` less numpy, packaging, filelock, fsspec and
typing_extensions (torch's environment has them), and are installed there with
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl .whl/hf/*.whl`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HFModelConfig:
    """A transformers causal LM's shape and the batch shape of a training step."""

    family: str  # "llama" or "mixtral"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    batch_size: int
    experts: int = 0
    experts_per_token: int = 0
    tie_embeddings: bool = False
    attention: str = "sdpa"  # or "sdpa-causal" (the module docstring)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def transformers_config(self):
        import transformers

        common = dict(vocab_size=self.vocab_size, hidden_size=self.d_model,
                      intermediate_size=self.ffn_hidden, num_hidden_layers=self.n_layers,
                      num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
                      max_position_embeddings=max(self.seq_len, 64),
                      tie_word_embeddings=self.tie_embeddings)
        if self.family == "llama":
            return transformers.LlamaConfig(**common)
        if self.family == "mixtral":
            return transformers.MixtralConfig(**common, num_local_experts=self.experts,
                                              num_experts_per_tok=self.experts_per_token)
        raise ValueError(f"unknown model family {self.family!r}: llama or mixtral")

    def parameter_count(self) -> int:
        with torch.device("meta"):
            model = HFCausalLM(self, dtype=torch.bfloat16, device="meta")
        return sum(p.numel() for p in model.parameters())


HF_PRESETS: dict[str, HFModelConfig] = {
    "hf-llama-1b": HFModelConfig("llama", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                                 ffn_hidden=8192, vocab_size=128256, seq_len=2048,
                                 batch_size=4, tie_embeddings=True),
    "hf-mixtral-moe": HFModelConfig("mixtral", n_layers=8, d_model=2048, n_heads=32,
                                    n_kv_heads=8, ffn_hidden=4096, vocab_size=32000,
                                    seq_len=2048, batch_size=4, experts=8, experts_per_token=2),
    "hf-mixtral-8x7b-2l": HFModelConfig("mixtral", n_layers=2, d_model=4096, n_heads=32,
                                        n_kv_heads=8, ffn_hidden=14336, vocab_size=32000,
                                        seq_len=2048, batch_size=4, experts=8,
                                        experts_per_token=2),
    "hf-llama-tiny": HFModelConfig("llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                                   ffn_hidden=128, vocab_size=256, seq_len=64, batch_size=2),
    "hf-mixtral-tiny": HFModelConfig("mixtral", n_layers=2, d_model=64, n_heads=4,
                                     n_kv_heads=2, ffn_hidden=128, vocab_size=256, seq_len=64,
                                     batch_size=2, experts=4, experts_per_token=2),
}
HF_PRESETS.update({f"{name}-causal": replace(HF_PRESETS[name], attention="sdpa-causal")
                   for name in ("hf-llama-1b", "hf-mixtral-moe", "hf-mixtral-8x7b-2l",
                                "hf-llama-tiny")})

CAUSAL_SDPA = "minifloat_benchmark_causal_sdpa"


def register_causal_sdpa() -> str:
    """transformers' SDPA attention under a name without a mask function (the module
    docstring): `create_causal_mask` then returns None, and the function takes is_causal."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transformers.AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


class HFCausalLM(nn.Module):
    """A transformers causal LM with the `loss(tokens)` that model_step.py trains."""

    def __init__(self, config: HFModelConfig, dtype: torch.dtype, device: str | torch.device
                 ) -> None:
        super().__init__()
        import transformers

        self.config = config
        if config.attention not in ("sdpa", "sdpa-causal"):
            raise ValueError(f"unknown attention {config.attention!r}: sdpa or sdpa-causal")
        attention = register_causal_sdpa() if config.attention == "sdpa-causal" else "sdpa"
        self.hf = transformers.AutoModelForCausalLM.from_config(
            config.transformers_config(), dtype=dtype,
            attn_implementation=attention).to(device)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
