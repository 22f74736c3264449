"""Mistral: Llama's layers (grouped-query attention, SwiGLU, no biases) where every layer sees
only the last `sliding_window` keys, itself included (HF's rule, Gemma's local layers'); the
device keeps each layer's keys in a ring of the window (`generate/device_plan.py`). From v0.2
on the window is null: every key, as Llama.

Weights use HF's `MistralForCausalLM` names. llama.cpp converts Mistral as `llama` (q/k rows
permuted, `gguf_weights`) and writes no window, as it attends to every key there: a `llama`
GGUF is read as Mistral only when it carries `llama.attention.sliding_window` (`gguf_claims`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from . import llama
from .config import LlamaConfig

ARCH = replace(llama.ARCH, model_type="mistral", gguf_arch="llama")


@dataclass(frozen=True)
class Config(LlamaConfig):
    model_type: ClassVar[str] = "mistral"
    architecture: ClassVar[str] = "MistralForCausalLM"
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131072
    sliding_window: int | None = 4096  # None: every key (v0.2 on)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        return super().from_dict({k: v for k, v in d.items() if k not in ("attention_bias", "mlp_bias")})

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None:
            self._require_positive("sliding_window")

    def window(self, index: int) -> int | None:
        """The keys every layer sees, itself included (None: all)."""
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for k in ("attention_bias", "mlp_bias"):
            d.pop(k)
        return d


expected_shapes = llama.expected_shapes
sanitize, unsanitize, gguf_weights = llama.sanitize, llama.unsanitize, llama.gguf_weights


def gguf_claims(meta: dict[str, Any]) -> bool:
    """A `llama` GGUF is Mistral's when it has a window."""
    return meta.get("llama.attention.sliding_window") is not None


def gguf_config(arch: str, get, path) -> dict:
    from .formats.gguf import llama_config

    return {**llama_config(arch, get, path), "sliding_window": int(get("attention.sliding_window"))}


class Model(llama.Model):
    """Llama's reference, which attends within the config's window."""


def build(config: Config, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
