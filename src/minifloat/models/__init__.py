"""Reference models built from minifloat modules."""

from .gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
