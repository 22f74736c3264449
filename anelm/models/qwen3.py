"""Qwen3: Llama with an RMSNorm over each query and key head, applied before RoPE.

Weights use HF's `Qwen3ForCausalLM` names; the head may be tied to the embedding or not.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import llama
from .registry import LLAMA_MODULES
from .config import Qwen3Config
from .layers import rms_norm

Config = Qwen3Config
# llama.cpp stores Qwen3 as HF does: no q/k permutation to undo (no gguf_weights)
ARCH = replace(llama.ARCH, model_type="qwen3", gguf_arch="qwen3",
               modules={**LLAMA_MODULES, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"})


def expected_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    shapes = llama.expected_shapes(c)
    for i in range(c.num_hidden_layers):
        shapes[f"model.layers.{i}.self_attn.q_norm.weight"] = (c.head_dim,)
        shapes[f"model.layers.{i}.self_attn.k_norm.weight"] = (c.head_dim,)
    return shapes


sanitize, unsanitize = llama.sanitize, llama.unsanitize


class Model(llama.Model):
    expected_shapes = staticmethod(expected_shapes)

    def qkv(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q, k, v = super().qkv(i, h)  # [Hq, T, hd], [Hkv, T, hd], [Hkv, T, hd]
        p, eps = f"model.layers.{i}.self_attn.", self.config.rms_norm_eps
        q = rms_norm(q, self.weights[p + "q_norm.weight"], eps)  # over hd, per head and position
        return q, rms_norm(k, self.weights[p + "k_norm.weight"], eps), v


def build(config: Qwen3Config, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
