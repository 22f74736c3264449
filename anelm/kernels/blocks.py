"""Whole transformer blocks as graphs (weights baked as BLOBFILE consts).

Weights are numpy float32 arrays keyed by the HF names inside one layer
(`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, ...), in PyTorch orientation `[out, in]`.
The config is anything with the HF config.json field names.
"""

from __future__ import annotations

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Graph, Value
from .attention import causal_attention, causal_mask, rope_tables


def _attr(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None) if not isinstance(cfg, dict) else cfg.get(n)
        if v is not None:
            return v
    return default


def swiglu(b: GraphBuilder, x: Value, w_gate, w_up, w_down, name: str = "mlp") -> Value:
    """down(silu(gate x) · up x); silu written as x·sigmoid(x) (CONTRACTS §2 conservative form)."""
    g = b.linear(x, w_gate, name=f"{name}_gate")
    u = b.linear(x, w_up, name=f"{name}_up")
    act = b.mul(g, b.sigmoid(g, name=f"{name}_sig"), name=f"{name}_silu")
    return b.linear(b.mul(act, u, name=f"{name}_prod"), w_down, name=f"{name}_down")


def llama_block(cfg, w: dict[str, np.ndarray], seq: int, offset: int = 0, name: str = "layer") -> Graph:
    """One Llama/Qwen3 decoder layer: x [1, D, 1, S] -> y [1, D, 1, S], causal over S positions."""
    d = _attr(cfg, "hidden_size")
    heads = _attr(cfg, "num_attention_heads")
    kv = _attr(cfg, "num_key_value_heads", default=heads)
    hd = _attr(cfg, "head_dim", default=d // heads)
    eps = float(_attr(cfg, "rms_norm_eps", default=1e-5))
    theta = float(_attr(cfg, "rope_theta", default=10000.0))
    b = GraphBuilder(name)
    x = b.input("x", [1, d, 1, seq])
    h = b.rms_norm(x, w["input_layernorm.weight"], eps, name="attn_norm")
    q = b.linear(h, w["self_attn.q_proj.weight"], name="q_proj")
    k = b.linear(h, w["self_attn.k_proj.weight"], name="k_proj")
    v = b.linear(h, w["self_attn.v_proj.weight"], name="v_proj")
    qk_norm = None
    if "self_attn.q_norm.weight" in w:
        qk_norm = (w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"], eps)
    rope = rope_tables(hd, np.arange(offset, offset + seq), theta)
    a = causal_attention(b, q, k, v, heads=heads, kv_heads=kv, head_dim=hd, mask=causal_mask(seq),
                         rope=rope, qk_norm=qk_norm)
    x2 = b.add(x, b.linear(a, w["self_attn.o_proj.weight"], name="o_proj"), name="resid1")
    h2 = b.rms_norm(x2, w["post_attention_layernorm.weight"], eps, name="mlp_norm")
    m = swiglu(b, h2, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
    b.output("y", b.add(x2, m, name="resid2"))
    return b.build()


def gpt2_block(cfg, w: dict[str, np.ndarray], seq: int, name: str = "layer") -> Graph:
    """One GPT-2 block (weights `[out, in]`, i.e. after transposing HF's Conv1D)."""
    d = _attr(cfg, "n_embd", "hidden_size")
    heads = _attr(cfg, "n_head", "num_attention_heads")
    eps = float(_attr(cfg, "layer_norm_epsilon", default=1e-5))
    hd = d // heads
    b = GraphBuilder(name)
    x = b.input("x", [1, d, 1, seq])
    h = b.layer_norm_decomposed(x, w["ln_1.weight"], w["ln_1.bias"], eps, name="ln1")
    wqkv, bqkv = w["attn.c_attn.weight"], w["attn.c_attn.bias"]  # [3D, D], [3D]
    q = b.linear(h, wqkv[:d], bqkv[:d], name="q_proj")
    k = b.linear(h, wqkv[d:2 * d], bqkv[d:2 * d], name="k_proj")
    v = b.linear(h, wqkv[2 * d:], bqkv[2 * d:], name="v_proj")
    a = causal_attention(b, q, k, v, heads=heads, kv_heads=heads, head_dim=hd, mask=causal_mask(seq))
    x2 = b.add(x, b.linear(a, w["attn.c_proj.weight"], w["attn.c_proj.bias"], name="o_proj"), name="resid1")
    h2 = b.layer_norm_decomposed(x2, w["ln_2.weight"], w["ln_2.bias"], eps, name="ln2")
    f = b.gelu_tanh(b.linear(h2, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"], name="fc"), name="gelu")
    m = b.linear(f, w["mlp.c_proj.weight"], w["mlp.c_proj.bias"], name="fc_proj")
    b.output("y", b.add(x2, m, name="resid2"))
    return b.build()


def random_llama_layer(d: int, heads: int, kv_heads: int, hidden: int, head_dim: int | None = None,
                       qk_norm: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for one Llama layer, scaled like a trained model's."""
    rng = np.random.default_rng(seed)
    hd = head_dim or d // heads

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    w = {
        "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "self_attn.q_proj.weight": lin(heads * hd, d),
        "self_attn.k_proj.weight": lin(kv_heads * hd, d),
        "self_attn.v_proj.weight": lin(kv_heads * hd, d),
        "self_attn.o_proj.weight": lin(d, heads * hd),
        "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "mlp.gate_proj.weight": lin(hidden, d),
        "mlp.up_proj.weight": lin(hidden, d),
        "mlp.down_proj.weight": lin(d, hidden),
    }
    if qk_norm:
        w["self_attn.q_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        w["self_attn.k_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    return w


def random_gpt2_layer(d: int, hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for one GPT-2 block, `[out, in]` orientation."""
    rng = np.random.default_rng(seed)

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def vec(n, scale=0.1, base=0.0):
        return (base + scale * rng.standard_normal(n)).astype(np.float32)

    return {"ln_1.weight": vec(d, base=1.0), "ln_1.bias": vec(d), "attn.c_attn.weight": lin(3 * d, d),
            "attn.c_attn.bias": vec(3 * d), "attn.c_proj.weight": lin(d, d), "attn.c_proj.bias": vec(d),
            "ln_2.weight": vec(d, base=1.0), "ln_2.bias": vec(d), "mlp.c_fc.weight": lin(hidden, d),
            "mlp.c_fc.bias": vec(hidden), "mlp.c_proj.weight": lin(d, hidden), "mlp.c_proj.bias": vec(d)}
