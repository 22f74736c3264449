"""Whole decoder layers as graphs (weights baked as BLOBFILE consts), for inspection and demos.

A layer here is the prefill kernel of the generation pipeline (`prefill.py`) without its
cache outputs, so the layer `anelm compile` writes is the one `anelm generate` runs.
Weights are numpy float32 arrays keyed by the HF names inside one layer
(`self_attn.q_proj.weight`, `attn.c_attn.weight`, ...), in `[out, in]` orientation (GPT-2's
Conv1D weights transposed, as `anelm.models.gpt2.sanitize` leaves them).
"""

from __future__ import annotations

import numpy as np

from ..ir.graph import Graph
from ..models.layers import rope_inv_freq, rope_tables
from .prefill import layer_params, layer_shape, prefill_layer, rope_full_tables


def decoder_layer(config, w: dict[str, np.ndarray], seq: int, index: int = 0, name: str = "layer") -> Graph:
    """Layer `index` of a GPT-2 / Llama / Qwen3 config: x `[1, D, 1, S]` -> y, causal over S positions."""
    s = layer_shape(config, index)
    rope = None
    if not s.gpt2:
        inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        rope = rope_full_tables(*rope_tables(np.arange(seq), inv))  # positions 0..S-1
    return prefill_layer(s, layer_params(s, w), seq, rope, name=name, kv_outputs=False)


def random_layer(config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for one layer of `config`, scaled like a trained model's."""
    rng = np.random.default_rng(seed)
    d, f = config.hidden_size, config.intermediate_size

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def vec(n, base=0.0):
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    if config.model_type == "gpt2":
        return {"ln_1.weight": vec(d, 1.0), "ln_1.bias": vec(d), "attn.c_attn.weight": lin(3 * d, d),
                "attn.c_attn.bias": vec(3 * d), "attn.c_proj.weight": lin(d, d), "attn.c_proj.bias": vec(d),
                "ln_2.weight": vec(d, 1.0), "ln_2.bias": vec(d), "mlp.c_fc.weight": lin(f, d),
                "mlp.c_fc.bias": vec(f), "mlp.c_proj.weight": lin(d, f), "mlp.c_proj.bias": vec(d)}
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    w = {"input_layernorm.weight": vec(d, 1.0), "self_attn.q_proj.weight": lin(q, d),
         "self_attn.k_proj.weight": lin(kv, d), "self_attn.v_proj.weight": lin(kv, d),
         "self_attn.o_proj.weight": lin(d, q), "post_attention_layernorm.weight": vec(d, 1.0),
         "mlp.gate_proj.weight": lin(f, d), "mlp.up_proj.weight": lin(f, d), "mlp.down_proj.weight": lin(d, f)}
    if config.model_type == "qwen3":
        w["self_attn.q_norm.weight"] = vec(config.head_dim, 1.0)
        w["self_attn.k_norm.weight"] = vec(config.head_dim, 1.0)
    return w
