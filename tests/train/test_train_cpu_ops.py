"""CPU ops of the training step against PyTorch autograd (and HF's own RoPE / repeat_kv).

Tolerance: 1e-5 in docs/testing.md's measure (max|got − ref| / max|ref|), far tighter than its
5e-2 for gradients, on purpose. Both sides compute the same float32 math and differ only
in summation order and libm rounding (≈ √K·6e-8 ≈ 1e-6 for our K ≤ 1000), whereas a wrong
formula, sign, axis or head mapping gives errors of order 1.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import (LlamaConfig, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb, repeat_kv)

from anelm.errors import ShapeError
from anelm.train.steps import cpu_ops as ops
import train_cpu_reference as ref
from helpers import rel_err

TOL = 1e-5


def rel(got, ref):
    return rel_err(got, ref.detach().numpy() if isinstance(ref, torch.Tensor) else ref)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def leaf(a):
    """A torch leaf of a numpy array (copied, so autograd never aliases our buffers)."""
    return torch.tensor(np.array(a), requires_grad=True)


def test_rmsnorm_fwd_bwd_vs_torch():
    rng = np.random.default_rng(0)
    c, s, eps = 96, 40, 1e-5
    x, w, dy = rand(rng, c, s, scale=3.0), rand(rng, c), rand(rng, c, s)
    y, rrms = ops.rmsnorm_fwd(x, w, eps)
    dx, dw = ops.rmsnorm_bwd(dy, x, w, rrms)
    xt, wt = leaf(x.T), leaf(w)  # torch normalizes the last axis: (S, C)
    yt = F.rms_norm(xt, (c,), wt, eps)
    yt.backward(torch.tensor(dy.T))
    assert y.dtype == dx.dtype == dw.dtype == np.float32
    assert rel(y.T, yt) < TOL and rel(dx.T, xt.grad) < TOL and rel(dw, wt.grad) < TOL


def test_head_rmsnorm_fwd_bwd_vs_torch():
    rng = np.random.default_rng(1)
    h, hd, s = 4, 16, 24
    x, w, dy = rand(rng, h * hd, s, scale=2.0), rand(rng, hd), rand(rng, h * hd, s)
    y, rrms = ops.head_rmsnorm_fwd(x, w, 1e-6)
    dx, dw = ops.head_rmsnorm_bwd(dy, x, w, rrms)
    xt, wt = leaf(x.reshape(h, hd, s).transpose(2, 0, 1)), leaf(w)  # (S, H, hd) as Qwen3 has it
    yt = F.rms_norm(xt, (hd,), wt, 1e-6)
    yt.backward(torch.tensor(dy.reshape(h, hd, s).transpose(2, 0, 1)))
    back = lambda t: t.detach().numpy().transpose(1, 2, 0).reshape(h * hd, s)  # noqa: E731
    assert rel(y, back(yt)) < TOL and rel(dx, back(xt.grad)) < TOL and rel(dw, wt.grad) < TOL


def test_silu_and_swiglu_vs_torch():
    rng = np.random.default_rng(2)
    h1, h3, dg = rand(rng, 64, 30, scale=4.0), rand(rng, 64, 30), rand(rng, 64, 30)
    h1[0, :3] = [-100.0, 100.0, 0.0]  # saturated tails must not produce NaN
    t1, t3 = leaf(h1), leaf(h3)
    gate = F.silu(t1) * t3
    gate.backward(torch.tensor(dg))
    dh1, dh3 = ops.swiglu_bwd(dg, h1, h3)
    assert rel(ref.swiglu_fwd(h1, h3), gate) < TOL
    assert rel(dh1, t1.grad) < TOL and rel(dh3, t3.grad) < TOL
    x = leaf(h1)
    F.silu(x).backward(torch.tensor(dg))
    assert rel(ref.silu_fwd(h1), F.silu(torch.tensor(h1))) < TOL
    assert rel(ref.silu_bwd(dg, h1), x.grad) < TOL


def _hf_rope(hd, theta, positions):
    cfg = LlamaConfig(hidden_size=hd * 2, num_attention_heads=2, head_dim=hd, rope_theta=theta)
    emb = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor(positions)[None]
    return emb(torch.zeros(1, dtype=torch.float32), pos)  # cos, sin: (1, S, hd)


@pytest.mark.parametrize("hd,theta", [(32, 1e4), (128, 1e6), (6, 1e4)])
def test_rope_fwd_and_inverse_vs_hf(hd, theta):
    rng = np.random.default_rng(3)
    h, seq = 3, 20
    positions = np.tile(np.arange(seq // 2), 2)  # two sequences side by side in the columns
    cos, sin = ops.rope_tables(hd, positions, theta)
    cos_t, sin_t = _hf_rope(hd, theta, positions)
    assert rel(cos.T, cos_t[0]) < TOL and rel(sin.T, sin_t[0]) < TOL
    q, k, dq, dk = (rand(rng, h * hd, seq) for _ in range(4))
    to_t = lambda a: leaf(a.reshape(h, hd, seq).transpose(0, 2, 1)[None])  # noqa: E731  (1, H, S, hd)
    qt, kt = to_t(q), to_t(k)
    qr, kr = apply_rotary_pos_emb(qt, kt, cos_t, sin_t)
    back = lambda t: t.detach()[0].numpy().transpose(0, 2, 1).reshape(h * hd, seq)  # noqa: E731
    assert rel(ops.rope_fwd(q, cos, sin), back(qr)) < TOL
    (qr * to_t(dq).detach()).sum().add((kr * to_t(dk).detach()).sum()).backward()
    assert rel(ops.rope_bwd(dq, cos, sin), back(qt.grad)) < TOL
    assert rel(ops.rope_bwd(dk, cos, sin), back(kt.grad)) < TOL


def test_rope_rejects_odd_head_dim_and_bad_shape():
    with pytest.raises(ShapeError, match="even head_dim"):
        ops.rope_tables(5, np.arange(4), 1e4)
    cos, sin = ops.rope_tables(8, np.arange(4), 1e4)
    with pytest.raises(ShapeError, match="expected"):
        ops.rope_fwd(np.zeros((12, 4), np.float32), cos, sin)


def test_gqa_expand_and_reduce_vs_hf_repeat_kv():
    rng = np.random.default_rng(4)
    n_heads, n_kv, hd, s = 8, 2, 4, 5
    kv, dfull = rand(rng, n_kv * hd, s), rand(rng, n_heads * hd, s)
    kt = leaf(kv.reshape(n_kv, hd, s).transpose(0, 2, 1)[None])  # (1, Hkv, S, hd)
    full = repeat_kv(kt, n_heads // n_kv)                          # (1, Hq, S, hd)
    full.backward(torch.tensor(dfull.reshape(n_heads, hd, s).transpose(0, 2, 1)[None]))
    got = ref.gqa_expand(kv, n_heads, hd)
    assert rel(got, full.detach()[0].numpy().transpose(0, 2, 1).reshape(n_heads * hd, s)) == 0
    red = ref.gqa_reduce(dfull, n_kv, hd)
    assert rel(red, kt.grad[0].numpy().transpose(0, 2, 1).reshape(n_kv * hd, s)) < TOL
    with pytest.raises(ShapeError):
        ref.gqa_expand(kv, 7, hd)


def test_embedding_fwd_bwd_with_repeated_ids_vs_torch():
    rng = np.random.default_rng(5)
    table, ids = rand(rng, 50, 12), np.array([3, 7, 3, 3, 0, 49, 7])
    dx = rand(rng, 12, len(ids))
    tt = leaf(table)
    out = F.embedding(torch.tensor(ids), tt)  # (S, D)
    out.backward(torch.tensor(dx.T))
    assert rel(ops.embed_fwd(table, ids), out.detach().numpy().T) == 0
    grad = ops.embed_bwd(dx, ids, np.zeros_like(table))
    assert rel(grad, tt.grad) < TOL
    acc = np.ones_like(table)  # adds into what is there (the tied classifier's dW)
    assert ops.embed_bwd(dx, ids, acc) is acc and rel(acc - 1.0, tt.grad) < TOL
    with pytest.raises(ShapeError, match=r"\[0, 50\)"):
        ops.embed_fwd(table, np.array([50]))


def test_cross_entropy_and_classifier_vs_torch():
    rng = np.random.default_rng(6)
    v, d, n, scale = 300, 32, 48, 1024.0
    w, x, t = rand(rng, v, d, scale=0.3), rand(rng, d, n), rng.integers(0, v, n)
    logits = ops.classifier_fwd(w, x)
    loss, dlog = ops.cross_entropy(logits, t, scale=scale)
    dx, dw = ref.classifier_bwd(dlog, w, x)
    wt, xt = leaf(w), leaf(x.T)  # torch: (N, D) rows, logits (N, V)
    lt = F.cross_entropy(F.linear(xt, wt), torch.tensor(t))
    (lt * scale).backward()
    assert abs(loss - lt.item()) / lt.item() < TOL
    assert rel(logits.T, F.linear(torch.tensor(x.T), torch.tensor(w))) < TOL
    assert rel(dx.T, xt.grad) < TOL and rel(dw, wt.grad) < TOL


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, -1e4], [0.0, 0.0], [-1e4, 1e4]], np.float32)  # (V=3, N=2)
    loss, d = ops.cross_entropy(logits, np.array([0, 1]))
    ref = F.cross_entropy(torch.tensor(logits.T), torch.tensor([0, 1]))
    assert np.isfinite(loss) and abs(loss - ref.item()) < 1e-3 and np.isfinite(d).all()


def test_dw_and_linear_dx_vs_torch_linear():
    rng = np.random.default_rng(7)
    w, x, dy = rand(rng, 24, 40), rand(rng, 40, 16), rand(rng, 24, 16)
    wt, xt = leaf(w), leaf(x.T)
    F.linear(xt, wt).backward(torch.tensor(dy.T))
    assert rel(ref.linear_fwd(w, x).T, F.linear(torch.tensor(x.T), torch.tensor(w))) < TOL
    assert ops.dw(dy, x).shape == (24, 40)  # [out, in], like the weight
    assert rel(ops.dw(dy, x), wt.grad) < TOL and rel(ref.linear_dx(w, dy).T, xt.grad) < TOL
    acc = np.ones((24, 40), np.float32)
    assert ops.dw(dy, x, out=acc) is acc and rel(acc - 1.0, wt.grad) < TOL


def test_flop_counters():
    assert ops.matmul_flops(2, 3, 4) == 48
    assert ops.rmsnorm_flops(10, 5, backward=True) > ops.rmsnorm_flops(10, 5) > 0
    assert ops.cross_entropy_flops(100, 8) == 4800 and ops.rope_flops(8, 2) > 0
    assert ops.embed_flops(4, 3, True) == 12


def test_cpu_step_flops_is_dominated_by_dw_and_classifier():
    cfg = {"hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12,
           "num_hidden_layers": 12, "vocab_size": 32000}
    n = 256
    dw = 12 * ops.matmul_flops(n, 768, 4 * 768 + 3 * 2048)
    head = 3 * ops.matmul_flops(32000, 768, n)
    total = ops.cpu_step_flops(cfg, n)
    assert dw + head < total < 1.05 * (dw + head)
    assert ops.cpu_step_flops({**cfg, "model_type": "qwen3"}, n) > total > ops.cpu_step_flops(
        cfg, n, rope_on_cpu=False)
