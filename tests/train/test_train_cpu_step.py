"""A whole training step composed from `cpu_ops` matches HF autograd, gradient for gradient.

The device's part (q/k/v/o and MLP projections, attention and their dx) is written here in
plain numpy, channel-first, the way the kernels lay it out; everything else is the CPU ops
under test. This pins down that the ops compose: layouts, HF weight orientation, head_dim
apart from hidden/heads, GQA mapping, q/k norm before RoPE, tied and untied heads, the loss
scale, and batches as sequences side by side in the columns.

Tolerance 1e-4 (max|got − ref| / max|ref|), below docs/testing.md's 5e-2: both sides are
float32 throughout and a two-layer model only compounds round-off; any wrong op is off by far
more.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3ForCausalLM

from anelm.train.steps import cpu_ops as ops
import train_cpu_reference as ref

B, T, SCALE = 2, 6, 256.0
BASE = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            rms_norm_eps=1e-6, rope_theta=500.0, attn_implementation="eager")


def attention_fwd(q, k, v, hd):
    """Causal attention per sequence block and head. q, k, v `[H·hd, B·T]` → out, probs."""
    h = q.shape[0] // hd
    out, probs = np.zeros_like(q), np.zeros((B, h, T, T), np.float32)
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    for b in range(B):
        cols = slice(b * T, (b + 1) * T)
        for i in range(h):
            rows = slice(i * hd, (i + 1) * hd)
            s = q[rows, cols].T @ k[rows, cols] / np.sqrt(hd) + mask  # (T queries, T keys)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[rows, cols], probs[b, i] = v[rows, cols] @ p.T, p
    return out, probs


def attention_bwd(da, q, k, v, probs, hd):
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        cols = slice(b * T, (b + 1) * T)
        for i in range(q.shape[0] // hd):
            rows, p = slice(i * hd, (i + 1) * hd), probs[b, i]
            dp = da[rows, cols].T @ v[rows, cols]
            dv[rows, cols] = da[rows, cols] @ p
            ds = p * (dp - (p * dp).sum(axis=1, keepdims=True)) / np.sqrt(hd)
            dq[rows, cols], dk[rows, cols] = k[rows, cols] @ ds.T, q[rows, cols] @ ds
    return dq, dk, dv


def layer_fwd(x, w, p, cfg, cos, sin):
    hd, hq, eps = cfg["head_dim"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    c = {"x": x}
    c["xn"], c["r1"] = ops.rmsnorm_fwd(x, w[p + "input_layernorm.weight"], eps)
    q, k = (ref.linear_fwd(w[p + f"self_attn.{n}_proj.weight"], c["xn"]) for n in "qk")
    c["v"] = ref.linear_fwd(w[p + "self_attn.v_proj.weight"], c["xn"])
    if cfg["qk_norm"]:
        c["q0"], c["k0"] = q, k
        q, c["rq"] = ops.head_rmsnorm_fwd(q, w[p + "self_attn.q_norm.weight"], eps)
        k, c["rk"] = ops.head_rmsnorm_fwd(k, w[p + "self_attn.k_norm.weight"], eps)
    c["q"], kr = ops.rope_fwd(q, cos, sin), ops.rope_fwd(k, cos, sin)
    c["kf"], c["vf"] = ref.gqa_expand(kr, hq, hd), ref.gqa_expand(c["v"], hq, hd)
    c["a"], c["probs"] = attention_fwd(c["q"], c["kf"], c["vf"], hd)
    c["x2"] = x + ref.linear_fwd(w[p + "self_attn.o_proj.weight"], c["a"])
    c["x2n"], c["r2"] = ops.rmsnorm_fwd(c["x2"], w[p + "post_attention_layernorm.weight"], eps)
    c["h1"] = ref.linear_fwd(w[p + "mlp.gate_proj.weight"], c["x2n"])
    c["h3"] = ref.linear_fwd(w[p + "mlp.up_proj.weight"], c["x2n"])
    c["g"] = ref.swiglu_fwd(c["h1"], c["h3"])
    return c["x2"] + ref.linear_fwd(w[p + "mlp.down_proj.weight"], c["g"]), c


def layer_bwd(dy, c, w, gr, p, cfg, cos, sin):
    hd, hkv = cfg["head_dim"], cfg["num_key_value_heads"]
    W = lambda n: w[p + n + ".weight"]  # noqa: E731
    gr[p + "mlp.down_proj.weight"] = ops.dw(dy, c["g"])
    dh1, dh3 = ops.swiglu_bwd(ref.linear_dx(W("mlp.down_proj"), dy), c["h1"], c["h3"])
    gr[p + "mlp.gate_proj.weight"] = ops.dw(dh1, c["x2n"])
    gr[p + "mlp.up_proj.weight"] = ops.dw(dh3, c["x2n"])
    dx2n = ref.linear_dx(W("mlp.gate_proj"), dh1) + ref.linear_dx(W("mlp.up_proj"), dh3)
    dx2, gr[p + "post_attention_layernorm.weight"] = ops.rmsnorm_bwd(
        dx2n, c["x2"], W("post_attention_layernorm"), c["r2"])
    dx2 += dy
    gr[p + "self_attn.o_proj.weight"] = ops.dw(dx2, c["a"])
    da = ref.linear_dx(W("self_attn.o_proj"), dx2)
    dq, dkf, dvf = attention_bwd(da, c["q"], c["kf"], c["vf"], c["probs"], hd)
    dq, dk = ops.rope_bwd(dq, cos, sin), ops.rope_bwd(ref.gqa_reduce(dkf, hkv, hd), cos, sin)
    dv = ref.gqa_reduce(dvf, hkv, hd)
    if cfg["qk_norm"]:
        dq, gr[p + "self_attn.q_norm.weight"] = ops.head_rmsnorm_bwd(
            dq, c["q0"], W("self_attn.q_norm"), c["rq"])
        dk, gr[p + "self_attn.k_norm.weight"] = ops.head_rmsnorm_bwd(
            dk, c["k0"], W("self_attn.k_norm"), c["rk"])
    dxn = 0
    for n, d in (("q", dq), ("k", dk), ("v", dv)):
        gr[p + f"self_attn.{n}_proj.weight"] = ops.dw(d, c["xn"])
        dxn = dxn + ref.linear_dx(W(f"self_attn.{n}_proj"), d)
    dx, gr[p + "input_layernorm.weight"] = ops.rmsnorm_bwd(dxn, c["x"], W("input_layernorm"), c["r1"])
    return dx + dx2


def our_step(w, cfg, ids, targets):
    """Loss and gradients (loss-scaled, then unscaled) of one batch, from the CPU ops."""
    tied = "lm_head.weight" not in w
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    cos, sin = ops.rope_tables(cfg["head_dim"], np.tile(np.arange(T), B), cfg["rope_theta"])
    x, caches = ops.embed_fwd(w["model.embed_tokens.weight"], ids.reshape(-1)), []
    for i in range(cfg["num_hidden_layers"]):
        x, c = layer_fwd(x, w, f"model.layers.{i}.", cfg, cos, sin)
        caches.append(c)
    xf, rf = ops.rmsnorm_fwd(x, w["model.norm.weight"], cfg["rms_norm_eps"])
    loss, dlog = ops.cross_entropy(ops.classifier_fwd(head, xf), targets.reshape(-1), SCALE)
    gr = {}
    dxf, dhead = ref.classifier_bwd(dlog, head, xf)
    dy, gr["model.norm.weight"] = ops.rmsnorm_bwd(dxf, x, w["model.norm.weight"], rf)
    for i in reversed(range(cfg["num_hidden_layers"])):
        dy = layer_bwd(dy, caches[i], w, gr, f"model.layers.{i}.", cfg, cos, sin)
    demb = dhead if tied else np.zeros_like(w["model.embed_tokens.weight"])
    gr["model.embed_tokens.weight"] = ops.embed_bwd(dy, ids.reshape(-1), demb)
    if not tied:
        gr["lm_head.weight"] = dhead
    return loss, {n: g / np.float32(SCALE) for n, g in gr.items()}


@pytest.mark.parametrize("arch,heads,kv,hd,tied", [
    ("llama", 4, 4, 8, True),     # MHA, tied
    ("llama", 4, 2, 8, False),    # GQA, untied
    ("qwen3", 4, 2, 12, True),    # GQA, q/k norm, head_dim ≠ hidden/heads
])
def test_cpu_ops_compose_to_hf_gradients(arch, heads, kv, hd, tied):
    torch.manual_seed(0)
    kw = dict(BASE, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
              tie_word_embeddings=tied)
    model = (Qwen3ForCausalLM(Qwen3Config(**kw)) if arch == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**kw))).float()
    with torch.no_grad():  # norm weights away from 1 so their gradients are exercised
        for n, prm in model.named_parameters():
            if prm.ndim == 1:
                prm.uniform_(0.5, 1.5)
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (B, T))
    logits = model(torch.tensor(ids)).logits
    ref = F.cross_entropy(logits.reshape(-1, 50), torch.tensor(targets).reshape(-1))
    ref.backward()
    w = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    if tied:
        w.pop("lm_head.weight", None)
    cfg = dict(kw, qk_norm=arch == "qwen3")
    loss, grads = our_step(w, cfg, ids, targets)
    assert abs(loss - ref.item()) / ref.item() < 1e-5
    named = dict(model.named_parameters())
    assert set(grads) == set(named)
    for n, g in grads.items():
        want = named[n].grad.numpy()
        assert np.max(np.abs(g - want)) / np.max(np.abs(want)) < 1e-4, n
