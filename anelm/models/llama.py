"""Llama: RMSNorm, RoPE (HF half-split), grouped-query attention, SwiGLU MLP.

Weights use HF's `LlamaForCausalLM` names. Reads in data-flow order: projections → rope →
attention → MLP → block → head.
"""

from __future__ import annotations

import math

import numpy as np

from .base import CausalLM
from .config import LlamaConfig
from .formats.llama2c import qk_interleaved_to_half
from .registry import LLAMA_ENDS, LLAMA_MODULES, LLAMA_PROJECTIONS, Architecture
from .layers import (apply_rope, attention, layer_inv_freqs, linear, per_distinct, rms_norm, rope_tables, silu,
                     split_heads)

Config = LlamaConfig
ARCH = Architecture("llama", family="llama", gguf_arch="llama", layer_prefix="model.layers.{}.",
                    modules=LLAMA_MODULES, ends=LLAMA_ENDS, projections=LLAMA_PROJECTIONS,
                    default_targets=("q_proj", "v_proj"))


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (d,)})
        if c.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,),
                           p + "mlp.down_proj.bias": (d,)})
    shapes["model.norm.weight"] = (d,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def sanitize(weights: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """Drop RoPE buffers some checkpoints carry, and the head copy when it is tied."""
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def gguf_weights(weights: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """llama.cpp's converter permutes q/k rows of llama-arch models for its interleaved RoPE: undone."""
    return qk_interleaved_to_half(weights, config)


def unsanitize(weights: dict[str, np.ndarray], config: LlamaConfig) -> dict[str, np.ndarray]:
    """Our weights as HF's checkpoint holds them (the inverse of `sanitize`): the same here."""
    return dict(weights)


class Model(CausalLM):
    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        c = config
        self.inv_freqs = layer_inv_freqs(c)  # one array per distinct RoPE (`config.rope(i)`)
        # scores scale by 1/√hd and by the square of RoPE's attention factor (YaRN's, `rope.py`)
        self.scales = [c.attention_factor(i) ** 2 / math.sqrt(c.head_dim) for i in range(c.num_hidden_layers)]

    expected_shapes = staticmethod(expected_shapes)

    def positions(self, pos: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's (cos, sin), computed once per call and distinct RoPE, shared by its layers."""
        return per_distinct(self.inv_freqs, lambda inv: rope_tables(pos, inv))

    def embed(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.weights["model.embed_tokens.weight"][ids]

    def project(self, i: int, name: str, x: np.ndarray) -> np.ndarray:
        p = f"model.layers.{i}.{name}"
        return self.adapted(p, x, linear(x, self.weights[p + ".weight"], self.weights.get(p + ".bias")))  # biases optional

    def qkv(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normed hidden [T, C] -> q [Hq, T, hd], k and v [Hkv, T, hd], before RoPE."""
        c = self.config
        q = split_heads(self.project(i, "self_attn.q_proj", h), c.num_attention_heads)
        k = split_heads(self.project(i, "self_attn.k_proj", h), c.num_key_value_heads)
        v = split_heads(self.project(i, "self_attn.v_proj", h), c.num_key_value_heads)
        return q, k, v

    def attend(self, i: int, h: np.ndarray, rope: list, cache) -> np.ndarray:
        q, k, v = self.qkv(i, h)
        cos, sin = rope[i]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = cache.length
        k_all, v_all = cache.store(i, k, v)
        out = attention(q, k_all, v_all, start, self.scales[i], self.config.window(i))  # a window: Mistral's
        return self.project(i, "self_attn.o_proj", out)

    def mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        """SwiGLU: down(silu(gate(h)) * up(h))."""
        g = self.project(i, "mlp.gate_proj", h)
        return self.project(i, "mlp.down_proj", silu(g) * self.project(i, "mlp.up_proj", h))

    def block(self, i: int, x: np.ndarray, rope: list, cache) -> np.ndarray:
        p, eps = f"model.layers.{i}.", self.config.rms_norm_eps
        x = x + self.attend(i, rms_norm(x, self.weights[p + "input_layernorm.weight"], eps), rope, cache)
        return x + self.mlp(i, rms_norm(x, self.weights[p + "post_attention_layernorm.weight"], eps))

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.weights["model.norm.weight"], self.config.rms_norm_eps)


def build(config: LlamaConfig, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
