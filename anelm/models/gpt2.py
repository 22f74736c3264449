"""GPT-2: LayerNorm, learned positions, fused QKV, GELU (tanh form), head tied to the embedding.

Weights use HF's `GPT2LMHeadModel` names. HF stores GPT-2's projections as `Conv1D` with
weights [in, out]; `sanitize` turns them to [out, in] like every other linear here, so the
device pipeline sees one orientation.
"""

from __future__ import annotations

import math

import numpy as np

from .base import CausalLM
from .config import GPT2Config
from .layers import attention, gelu_tanh, layer_norm, linear, split_heads
from .registry import Architecture

Config = GPT2Config
ARCH = Architecture("gpt2", family="gpt2", gguf_arch="gpt2", layer_prefix="transformer.h.{}.",
                    modules={"attn_norm": "ln_1", "qkv": "attn.c_attn", "o": "attn.c_proj", "mlp_norm": "ln_2",
                             "fc": "mlp.c_fc", "proj": "mlp.c_proj"},
                    ends={"embed": "transformer.wte.weight", "positions": "transformer.wpe.weight",
                          "final_norm": "transformer.ln_f.weight", "head": "lm_head.weight"},
                    projections=("qkv", "o", "fc", "proj"), default_targets=("c_attn",),
                    base_prefix="transformer.", conv1d=True)
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # stored [in, out] by HF


def expected_shapes(c: GPT2Config) -> dict[str, tuple[int, ...]]:
    d, f = c.n_embd, c.n_inner
    shapes = {"transformer.wte.weight": (c.vocab_size, d), "transformer.wpe.weight": (c.n_positions, d)}
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            shapes[p + ln + ".weight"] = shapes[p + ln + ".bias"] = (d,)
        for name, (n_out, n_in) in zip(CONV1D, ((3 * d, d), (d, d), (f, d), (d, f))):
            shapes[p + name + ".weight"], shapes[p + name + ".bias"] = (n_out, n_in), (n_out,)
    shapes["transformer.ln_f.weight"] = shapes["transformer.ln_f.bias"] = (d,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def gguf_config(arch: str, get, path) -> dict:
    """The config's fields from llama.cpp's `gpt2.*` metadata (`get(key)`)."""
    return dict(n_embd=get("embedding_length"), n_layer=get("block_count"), n_head=get("attention.head_count"),
                n_positions=get("context_length"), n_inner=get("feed_forward_length"),
                layer_norm_epsilon=get("attention.layer_norm_epsilon"))


def sanitize(weights: dict[str, np.ndarray], config: GPT2Config) -> dict[str, np.ndarray]:
    """HF checkpoint -> our names and orientation: `transformer.` prefix (OpenAI's files lack
    it), no causal-mask buffers (`attn.bias`, `attn.masked_bias`), Conv1D weights as [out, in]."""
    out = {}
    for k, v in weights.items():
        if not k.startswith(("transformer.", "lm_head.")):
            k = "transformer." + k
        if k.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if k.endswith(".weight") and k.removesuffix(".weight").endswith(CONV1D) and np.ndim(v) == 2:
            v = np.asarray(v).T
        out[k] = v
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def unsanitize(weights: dict[str, np.ndarray], config: GPT2Config) -> dict[str, np.ndarray]:
    """Our weights as HF's checkpoint holds them (the inverse of `sanitize`): Conv1D as [in, out]."""
    return {k: np.ascontiguousarray(v.T) if k.removesuffix(".weight").endswith(CONV1D) and k.endswith(".weight")
            else v for k, v in weights.items()}


class Model(CausalLM):
    expected_shapes = staticmethod(expected_shapes)

    def __init__(self, config: GPT2Config, weights: dict[str, np.ndarray]):
        super().__init__(config, weights)
        self.base_scale = 1.0 / math.sqrt(config.head_dim) if config.scale_attn_weights else 1.0

    def _lin(self, name: str, x: np.ndarray) -> np.ndarray:
        return linear(x, self.weights[name + ".weight"], self.weights[name + ".bias"])

    def project(self, i: int, name: str, x: np.ndarray) -> np.ndarray:
        """Layer i's projection `name` (attn.c_attn ...): every one goes through here, as in
        llama.py, so that anelm.quant.calibrate can watch their inputs."""
        p = f"transformer.h.{i}.{name}"
        return self.adapted(p, x, self._lin(p, x))

    def _ln(self, name: str, x: np.ndarray) -> np.ndarray:
        return layer_norm(x, self.weights[name + ".weight"], self.weights[name + ".bias"],
                          self.config.layer_norm_epsilon)

    def embed(self, ids: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.weights["transformer.wte.weight"][ids] + self.weights["transformer.wpe.weight"][pos]

    def qkv(self, i: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Normed hidden [T, C] -> q, k, v each [H, T, hd]."""
        q, k, v = np.split(self.project(i, "attn.c_attn", h), 3, axis=-1)  # 3 x [T, C]
        n = self.config.n_head
        return split_heads(q, n), split_heads(k, n), split_heads(v, n)

    def attend(self, i: int, h: np.ndarray, cache) -> np.ndarray:
        q, k, v = self.qkv(i, h)
        scale = self.base_scale / (i + 1) if self.config.scale_attn_by_inverse_layer_idx else self.base_scale
        start = cache.length
        k_all, v_all = cache.store(i, k, v)
        return self.project(i, "attn.c_proj", attention(q, k_all, v_all, start, scale))

    def mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        return self.project(i, "mlp.c_proj", gelu_tanh(self.project(i, "mlp.c_fc", h)))

    def block(self, i: int, x: np.ndarray, pos: np.ndarray, cache) -> np.ndarray:
        p = f"transformer.h.{i}."
        x = x + self.attend(i, self._ln(p + "ln_1", x), cache)
        return x + self.mlp(i, self._ln(p + "ln_2", x))

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return self._ln("transformer.ln_f", x)


def build(config: GPT2Config, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
