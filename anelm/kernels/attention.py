"""Causal attention on BC1S tensors, in the forms the `strict` profile takes.

Heads live in a rank-4 layout `[Hkv, G, Dh, S]` (G = query heads per KV head): the query
projection `[1, H·Dh, 1, S]` reshapes to it directly because query head h = kv·G + g uses KV
head kv = h // G (HF's GQA mapping), and K/V reshape to `[Hkv, 1, Dh, S]` so matmul
broadcasts them over G. No tiling, no concat.

RoPE (HF half-split convention) works on the two halves of Dh separately:
    q1' = q1·cos − q2·sin,  q2' = q2·cos + q1·sin
and the scores are q'ᵀk' = q1'ᵀk1' + q2'ᵀk2', so the rotated halves never need joining.

The causal mask is an additive const (hardware SDPA ignores masks, strict §2.5); −1e4 rather
than −65504 so that `score + mask` cannot overflow fp16 to −inf (ml-ane-transformers).
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Value

MASK_VALUE = -1e4


def rope_tables(head_dim: int, positions: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [Dh/2, S] for HF's half-split RoPE at the given positions."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.outer(inv_freq, np.asarray(positions, dtype=np.float64))  # [Dh/2, S]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def causal_mask(seq: int, keys: int | None = None, offset: int = 0) -> np.ndarray:
    """[1, 1, S, T] additive mask: query i (at position offset+i) may see keys j ≤ offset+i."""
    keys = seq if keys is None else keys
    q = np.arange(seq)[:, None] + offset
    k = np.arange(keys)[None, :]
    return np.where(k <= q, 0.0, MASK_VALUE).astype(np.float32)[None, None]


def split_heads(b: GraphBuilder, x: Value, heads: int, groups: int, head_dim: int, name: str) -> Value:
    """[1, heads·groups·Dh, 1, S] -> [heads, groups, Dh, S]."""
    s = x.shape[3]
    return b.reshape(x, [heads, groups, head_dim, s], name=name)


def head_rms_norm(b: GraphBuilder, x: Value, weight: np.ndarray, eps: float, name: str) -> Value:
    """RMSNorm over Dh of a `[Hkv, G, Dh, S]` tensor (Qwen3's q/k norm), as reduce_sum × 1/Dh."""
    dh = x.shape[2]
    ss = b.reduce_sum(b.mul(x, x, name=f"{name}_sq"), axes=[2], name=f"{name}_ss")
    ms = b.add(b.mul(ss, 1.0 / dh, name=f"{name}_ms"), eps, name=f"{name}_mse")
    r = b.pow(ms, -0.5, name=f"{name}_rrms")
    w = b.weight(f"{name}_w", np.reshape(weight, (1, 1, dh, 1)))
    return b.mul(b.mul(x, r, name=f"{name}_xr"), w, name=name)


def rope_halves(b: GraphBuilder, x: Value, cos: Value, sin: Value, name: str) -> tuple[Value, Value]:
    """The rotated halves (x1', x2') of `[Hkv, G, Dh, S]` along Dh."""
    h, g, dh, s = x.shape
    half = dh // 2
    x1 = b.slice_by_size(x, [0, 0, 0, 0], [h, g, half, s], name=f"{name}_x1")
    x2 = b.slice_by_size(x, [0, 0, half, 0], [h, g, half, s], name=f"{name}_x2")
    r1 = b.sub(b.mul(x1, cos, name=f"{name}_x1c"), b.mul(x2, sin, name=f"{name}_x2s"), name=f"{name}_r1")
    r2 = b.add(b.mul(x2, cos, name=f"{name}_x2c"), b.mul(x1, sin, name=f"{name}_x1s"), name=f"{name}_r2")
    return r1, r2


def causal_attention(b: GraphBuilder, q: Value, k: Value, v: Value, *, heads: int, kv_heads: int,
                     head_dim: int, mask: np.ndarray, rope: tuple[np.ndarray, np.ndarray] | None = None,
                     qk_norm: tuple[np.ndarray, np.ndarray, float] | None = None,
                     name: str = "attn") -> Value:
    """softmax(QKᵀ/√Dh + mask)·V for BC1S projections; returns `[1, H·Dh, 1, S]`.

    `q` is `[1, H·Dh, 1, S]`, `k`/`v` are `[1, Hkv·Dh, 1, T]` (T = S for a full sequence),
    `mask` is `[1, 1, S, T]`, `rope` = (cos, sin) tables `[Dh/2, S]` for queries and keys
    alike, `qk_norm` = (q_norm weight, k_norm weight, eps) for Qwen3.
    """
    groups, s = heads // kv_heads, q.shape[3]
    qh = split_heads(b, q, kv_heads, groups, head_dim, f"{name}_qh")  # [Hkv, G, Dh, S]
    kh = split_heads(b, k, kv_heads, 1, head_dim, f"{name}_kh")  # [Hkv, 1, Dh, T]
    vh = split_heads(b, v, kv_heads, 1, head_dim, f"{name}_vh")  # [Hkv, 1, Dh, T]
    if qk_norm is not None:
        qh = head_rms_norm(b, qh, qk_norm[0], qk_norm[2], f"{name}_qn")
        kh = head_rms_norm(b, kh, qk_norm[1], qk_norm[2], f"{name}_kn")
    if rope is not None:
        half = head_dim // 2
        cos = b.const(rope[0].reshape(1, 1, half, -1), name=f"{name}_cos", dtype="fp16", blob=True)
        sin = b.const(rope[1].reshape(1, 1, half, -1), name=f"{name}_sin", dtype="fp16", blob=True)
        q1, q2 = rope_halves(b, qh, cos, sin, f"{name}_qr")
        k1, k2 = rope_halves(b, kh, cos, sin, f"{name}_kr")
        sc = b.add(b.matmul(q1, k1, transpose_x=True, name=f"{name}_s1"),
                   b.matmul(q2, k2, transpose_x=True, name=f"{name}_s2"), name=f"{name}_qk")
    else:
        sc = b.matmul(qh, kh, transpose_x=True, name=f"{name}_qk")  # [Hkv, G, S, T]
    scaled = b.mul(sc, 1.0 / math.sqrt(head_dim), name=f"{name}_scaled")
    m = b.const(mask, name=f"{name}_mask", dtype="fp16", blob=True)
    p = b.softmax(b.add(scaled, m, name=f"{name}_masked"), axis=-1, name=f"{name}_p")
    ot = b.matmul(vh, p, transpose_y=True, name=f"{name}_pv")  # [Hkv, G, Dh, S]
    return b.reshape(ot, [1, heads * head_dim, 1, s], name=name)
