"""Gemma 3 (text): Llama's attention and gated MLP, with what Gemma changes in a layer.

- Four RMSNorms per layer, each with gain 1 + w: before attention (`input_layernorm`), on the
  attention's output before the residual add (`post_attention_layernorm`), before the MLP
  (`pre_feedforward_layernorm`) and on the MLP's output (`post_feedforward_layernorm`).
- Per-head RMSNorm of q and k (gain 1 + w) before RoPE; scores scaled by
  `query_pre_attn_scalar`^-0.5 rather than head_dim^-0.5.
- Gated MLP with GELU's tanh form; embeddings multiplied by √hidden_size; a tied head.
- Per layer kind (`config.layer_types`): sliding layers see the last `sliding_window` keys and
  use RoPE base `rope_local_base_freq`; full layers see every key and use `rope_theta`.

Weights use HF's `Gemma3ForCausalLM` names; norm weights are HF's w (the gain is 1 + w).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np

from . import llama
from .config import Gemma3TextConfig
from .layers import apply_rope, attention, gelu_tanh, rms_norm
from .registry import LLAMA_MODULES

Config = Gemma3TextConfig
ARCH = replace(llama.ARCH, model_type="gemma3_text", family="gemma", gguf_arch="gemma3",
               modules={**LLAMA_MODULES, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                        "attn_post_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
                        "mlp_post_norm": "post_feedforward_layernorm"},
               aliases=("gemma3",))  # a multimodal folder: its text model (`sanitize`)
POST_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# a multimodal `gemma3` checkpoint keeps the text model under another prefix (transformers 4 and 5)
TEXT_PREFIX = re.compile(r"^(?:model\.language_model\.|language_model\.model\.|language_model\.)")


def expected_shapes(c: Gemma3TextConfig) -> dict[str, tuple[int, ...]]:
    shapes = llama.expected_shapes(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
        shapes.update({p + n + ".weight": (c.hidden_size,) for n in POST_NORMS})
    return shapes


def sanitize(weights: dict[str, np.ndarray], config: Gemma3TextConfig) -> dict[str, np.ndarray]:
    """The text model's weights under `Gemma3ForCausalLM` names: a multimodal folder's
    `language_model` prefix becomes `model.`, its vision tower and projector are dropped."""
    out = {}
    for k, v in weights.items():
        name = TEXT_PREFIX.sub("model.", k)
        if name.startswith("model.") or name == "lm_head.weight":
            out[name] = v
    return llama.sanitize(out, config)


unsanitize = llama.unsanitize


def gguf_config(arch: str, get, path) -> dict:
    """Llama's fields from llama.cpp's `gemma3.*` metadata, plus the window. llama.cpp keeps the
    local RoPE base and the five-to-one layer pattern as constants (HF's defaults, too); it
    scales scores by head_dim^-0.5 except on the 27B (62 layers), which uses hidden / heads."""
    from .formats.gguf import llama_config

    d = llama_config(arch, get, path)
    d.update(sliding_window=get("attention.sliding_window"), hidden_act="gelu_pytorch_tanh",
             query_pre_attn_scalar=d["head_dim"] if d["num_hidden_layers"] != 62
             else d["hidden_size"] // d["num_attention_heads"])
    return d


def gguf_weights(weights: dict[str, np.ndarray], config: Gemma3TextConfig) -> dict[str, np.ndarray]:
    """llama.cpp's converter stores every Gemma norm weight as 1 + w (the gain itself): back to w."""
    for k, v in weights.items():
        if k.endswith("norm.weight"):
            v -= np.float32(1.0)
    return weights


def norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's RMSNorm: gain 1 + w."""
    return rms_norm(x, np.float32(1.0) + w, eps)


class Model(llama.Model):
    expected_shapes = staticmethod(expected_shapes)

    def __init__(self, config: Gemma3TextConfig, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        c = config
        self.scales = [c.attention_factor(i) ** 2 / math.sqrt(c.query_pre_attn_scalar)
                       for i in range(c.num_hidden_layers)]
        # HF multiplies by the scale cast to the weights' dtype: √640 as a float32
        self.embed_scale = np.float32(math.sqrt(c.hidden_size))

    def embed(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return np.asarray(self.weights["model.embed_tokens.weight"][ids], np.float32) * self.embed_scale

    def attend(self, i: int, h: np.ndarray, rope: list, cache) -> np.ndarray:
        p, eps = f"model.layers.{i}.self_attn.", self.config.rms_norm_eps
        q, k, v = self.qkv(i, h)
        q, k = norm(q, self.weights[p + "q_norm.weight"], eps), norm(k, self.weights[p + "k_norm.weight"], eps)
        cos, sin = rope[i]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = cache.length
        k_all, v_all = cache.store(i, k, v)
        out = attention(q, k_all, v_all, start, self.scales[i], self.config.window(i))
        return self.project(i, "self_attn.o_proj", out)

    def mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        """down(gelu_tanh(gate(h)) * up(h))."""
        g = self.project(i, "mlp.gate_proj", h)
        return self.project(i, "mlp.down_proj", gelu_tanh(g) * self.project(i, "mlp.up_proj", h))

    def block(self, i: int, x: np.ndarray, rope: list, cache) -> np.ndarray:
        p, eps, w = f"model.layers.{i}.", self.config.rms_norm_eps, self.weights
        a = self.attend(i, norm(x, w[p + "input_layernorm.weight"], eps), rope, cache)
        x = x + norm(a, w[p + "post_attention_layernorm.weight"], eps)
        m = self.mlp(i, norm(x, w[p + "pre_feedforward_layernorm.weight"], eps))
        return x + norm(m, w[p + "post_feedforward_layernorm.weight"], eps)

    def stream_bound(self) -> float:
        """Every layer adds two post-norm outputs, each at most √C times its largest gain (an
        RMS-normalised vector has no entry above √C), to the scaled embedding."""
        c, w = self.config, self.weights
        root = math.sqrt(c.hidden_size)
        bound = float(np.abs(w["model.embed_tokens.weight"]).max()) * float(self.embed_scale)
        for i in range(c.num_hidden_layers):
            for n in ("post_attention_layernorm", "post_feedforward_layernorm"):
                bound += root * float(np.abs(np.float32(1.0) + w[f"model.layers.{i}.{n}.weight"]).max())
        return bound

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return norm(x, self.weights["model.norm.weight"], self.config.rms_norm_eps)


def build(config: Gemma3TextConfig, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
