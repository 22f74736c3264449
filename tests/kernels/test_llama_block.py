"""Decoder layers (the prefill kernel that generation runs, built with the builder), compiled, run
on the emulator, against float32 PyTorch references written here (HF semantics: half-split
RoPE, GQA h // group, SwiGLU, q/k norm; GPT-2 LayerNorm, biases, GELU tanh form).

Tolerance: docs/testing.md, a transformer block ≤ 2e-2 of max|ref| (every op rounds to fp16,
~5e-4 relative each, over ~40 ops on the longest path).
"""

import numpy as np
import pytest
import torch

from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.kernels.blocks import decoder_layer
from anelm.models.names import random_layer
from anelm.models.config import GPT2Config, LlamaConfig, Qwen3Config
from anelm.runtime.kernel import Kernel
from helpers import rel_err


def torch_llama_layer(x, w, heads, kv, hd, eps, theta, qk_norm):
    """x: [S, D] float32 -> [S, D]."""
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    s = x.shape[0]

    def rms(v, g):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * g

    def rot(v):
        h = v.shape[-1] // 2
        return torch.cat([-v[..., h:], v[..., :h]], dim=-1)

    h = rms(x, t["input_layernorm.weight"])
    q = (h @ t["self_attn.q_proj.weight"].T).view(s, heads, hd).transpose(0, 1)
    k = (h @ t["self_attn.k_proj.weight"].T).view(s, kv, hd).transpose(0, 1)
    v = (h @ t["self_attn.v_proj.weight"].T).view(s, kv, hd).transpose(0, 1)
    if qk_norm:
        q, k = rms(q, t["self_attn.q_norm.weight"]), rms(k, t["self_attn.k_norm.weight"])
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    x2 = x + a.transpose(0, 1).reshape(s, heads * hd) @ t["self_attn.o_proj.weight"].T
    h2 = rms(x2, t["post_attention_layernorm.weight"])
    g = h2 @ t["mlp.gate_proj.weight"].T
    m = (torch.nn.functional.silu(g) * (h2 @ t["mlp.up_proj.weight"].T)) @ t["mlp.down_proj.weight"].T
    return (x2 + m).numpy()


@pytest.mark.parametrize("heads,kv,qk_norm", [(4, 4, False), (4, 2, False), (4, 2, True)])
def test_llama_block_matches_torch(heads, kv, qk_norm):
    d, hd, hidden, seq = 64, 16, 160, 32
    make = Qwen3Config if qk_norm else LlamaConfig
    cfg = make(hidden_size=d, intermediate_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-5, rope_theta=10000.0)
    w = random_layer(cfg, seed=heads + kv)
    art = compile_graph(decoder_layer(cfg, w, seq))
    assert "concat" not in art.mil_text and "gelu" not in art.mil_text
    x = np.random.default_rng(1).standard_normal((seq, d)).astype(np.float32)
    got = Kernel(art, Emulator())(x=x.T.reshape(1, d, 1, seq))["y"].astype(np.float32)
    ref = torch_llama_layer(torch.from_numpy(x), w, heads, kv, hd, 1e-5, 10000.0, qk_norm)
    err = rel_err(got.reshape(d, seq).T, ref)
    assert err <= 2e-2, err


def test_gpt2_block_matches_torch():
    d, heads, seq = 64, 4, 32
    rng = np.random.default_rng(3)
    cfg = GPT2Config(n_embd=d, n_head=heads, n_layer=1, layer_norm_epsilon=1e-5)
    w = random_layer(cfg, seed=3)
    art = compile_graph(decoder_layer(cfg, w, seq))
    x = rng.standard_normal((seq, d)).astype(np.float32)
    got = Kernel(art, Emulator())(x=x.T.reshape(1, d, 1, seq))["y"].astype(np.float32).reshape(d, seq).T

    t = {k: torch.from_numpy(v) for k, v in w.items()}
    xt = torch.from_numpy(x)
    ln = torch.nn.functional.layer_norm
    h = ln(xt, (d,), t["ln_1.weight"], t["ln_1.bias"], 1e-5)
    qkv = h @ t["attn.c_attn.weight"].T + t["attn.c_attn.bias"]
    q, k, v = (z.view(seq, heads, d // heads).transpose(0, 1) for z in qkv.split(d, -1))
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(seq, d)
    x2 = xt + a @ t["attn.c_proj.weight"].T + t["attn.c_proj.bias"]
    h2 = ln(x2, (d,), t["ln_2.weight"], t["ln_2.bias"], 1e-5)
    f = torch.nn.functional.gelu(h2 @ t["mlp.c_fc.weight"].T + t["mlp.c_fc.bias"], approximate="tanh")
    ref = (x2 + f @ t["mlp.c_proj.weight"].T + t["mlp.c_proj.bias"]).numpy()
    err = rel_err(got, ref)
    assert err <= 2e-2, err
