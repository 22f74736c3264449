"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections (not on o), and HF's
optional sliding window (`use_sliding_window`: the layers from `max_window_layers` on see the
last `sliding_window` keys; off in the released checkpoints). The long-context variants scale
RoPE with YaRN (`rope.py`).

Weights use HF's `Qwen2ForCausalLM` names; the head may be tied (0.5B, 1.5B) or not. llama.cpp
stores Qwen2 as HF does (GGUF `qwen2`, no q/k permutation to undo, so no gguf_weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from . import llama
from .config import LlamaConfig, layer_window, set_layer_types

ARCH = replace(llama.ARCH, model_type="qwen2", gguf_arch="qwen2")


@dataclass(frozen=True)
class Config(LlamaConfig):
    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    vocab_size: int = 151936
    intermediate_size: int = 22016
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None  # None: HF's, from the three keys above

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        # the biases are the architecture's (q, k, v), not Llama's flags
        d = {k: v for k, v in d.items() if k not in ("attention_bias", "mlp_bias")}
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return super().from_dict(d)

    def __post_init__(self):
        super().__post_init__()
        set_layer_types(self, lambda i: i >= self.max_window_layers)

    window = layer_window

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for k in ("attention_bias", "mlp_bias"):
            d.pop(k)
        d["layer_types"] = list(self.layer_types)
        return d


def expected_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    shapes = llama.expected_shapes(c)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        shapes.update({p + "q_proj.bias": (q,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)})
    return shapes


sanitize, unsanitize = llama.sanitize, llama.unsanitize


class Model(llama.Model):
    """Llama's reference: `project` adds a bias wherever the weights hold one, `attend` keeps
    to the config's window."""

    expected_shapes = staticmethod(expected_shapes)


def build(config: Config, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
