"""Float32 numpy building blocks with HF semantics: the CPU reference path.

Activations are [T, C] (tokens, channels); attention works per head on [H, T, hd]. Weights are
in `nn.Linear` orientation [out, in], so a projection is `x @ w.T`. Each piece is a small
function so the device pipeline can swap one for a compiled kernel and compare the rest.
"""

from __future__ import annotations

import math

import numpy as np

from .rope import rope_frequencies


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    y = x @ w.T  # [T, in] @ [in, out] -> [T, out]
    return y if b is None else y + b


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(ms + np.float32(eps)) * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean(np.square(x - mu), axis=-1, keepdims=True)  # biased, as torch
    return (x - mu) / np.sqrt(var + np.float32(eps)) * w + b


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def split_heads(x: np.ndarray, n_heads: int) -> np.ndarray:
    t, c = x.shape
    return x.reshape(t, n_heads, c // n_heads).transpose(1, 0, 2)  # [T, H*hd] -> [H, T, hd]


def merge_heads(x: np.ndarray) -> np.ndarray:
    h, t, hd = x.shape
    return x.transpose(1, 0, 2).reshape(t, h * hd)  # [H, T, hd] -> [T, H*hd]


# --- RoPE, HF's half-split convention: dimension i pairs with i + hd/2 ----------------------
# The one definition of the tables: the CPU reference, the device graphs (kernels/) and the
# training step (train/steps/cpu_ops.py, channel-first) all take them from here.

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Per-pair angular frequencies [hd/2] of RoPE with base `theta` and HF's `scaling`
    (`rope.py`, one implementation of every rope type), as HF's float32 tables hold them."""
    return rope_frequencies(head_dim, theta, scaling)[0]


def layer_inv_freqs(config) -> list[np.ndarray]:
    """Each layer's frequencies (`config.rope(i)`: Gemma's local and global layers differ), one
    array per distinct base and scaling, shared by the layers that use it (`per_distinct`)."""
    made: dict[str, np.ndarray] = {}
    for i in range(config.num_hidden_layers):
        key = repr(config.rope(i))
        if key not in made:
            made[key] = rope_inv_freq(config.head_dim, *config.rope(i))
    return [made[repr(config.rope(i))] for i in range(config.num_hidden_layers)]


def per_distinct(arrays: list, make) -> list:
    """`make(a)` for each of `arrays`, made once per distinct array (by identity): each layer's
    RoPE tables, computed once per base."""
    made: dict[int, object] = {}
    for a in arrays:
        if id(a) not in made:
            made[id(a)] = make(a)
    return [made[id(a)] for a in arrays]


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each [T, hd/2], for absolute positions [T]."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    return np.cos(ang), np.sin(ang)


def rope_full_width(table: np.ndarray) -> np.ndarray:
    """A per-pair table [T, hd/2] channel-first over the whole head, [hd, T]: row i and row
    i + hd/2 hold the same angle (the layout of the device graphs and the training step)."""
    return np.ascontiguousarray(np.concatenate([table, table], axis=-1).T, dtype=np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [H, T, hd]: rotate (x1, x2) = the two halves of each head by the position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty_like(x)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out


# --- attention -----------------------------------------------------------------------------

def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float,
              window: int | None = None) -> np.ndarray:
    """Causal attention of T new queries at positions start.. over S = start + T cached keys.

    q [Hq, T, hd]; k, v [Hkv, S, hd]; query head h reads KV head h // (Hq // Hkv). `window`:
    a sliding window, a query at position i sees the keys at i − window < j <= i (HF's rule).
    Returns [T, Hq*hd].
    """
    hq, t, hd = q.shape
    hkv, s, _ = k.shape
    qg = q.reshape(hkv, hq // hkv, t, hd)  # [Hkv, rep, T, hd]: head h = g*rep + r
    scores = (qg @ k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # [Hkv, rep, T, S]
    future = np.arange(s)[None, :] > (start + np.arange(t))[:, None]  # [T, S]
    if window is not None:
        future |= np.arange(s)[None, :] <= (start + np.arange(t))[:, None] - window
    scores = np.where(future, np.float32(-np.inf), scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = probs @ v[:, None]  # [Hkv, rep, T, hd]
    return merge_heads(out.reshape(hq, t, hd))


class KVCache:
    """Per-layer keys and values [L, Hkv, S, hd], grown in steps up to `capacity` positions.

    `length` counts the positions stored; a prefill or decode writes at `length` and then
    advances it, so a cache carries one conversation from turn to turn.
    """

    STEP = 256  # positions added per growth: a long context is not allocated up front

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k = np.zeros((n_layers, n_kv_heads, 0, head_dim), np.float32)
        self.v = np.zeros_like(self.k)

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v [Hkv, T, hd] at `length`; return all keys and values so far [Hkv, S, hd]."""
        end = self.length + k.shape[1]
        if end > self.k.shape[2]:
            self._grow(end)
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def _grow(self, need: int) -> None:
        size = min(self.capacity, max(need, self.k.shape[2] * 2, self.STEP))
        pad = [(0, 0), (0, 0), (0, size - self.k.shape[2]), (0, 0)]
        self.k, self.v = np.pad(self.k, pad), np.pad(self.v, pad)
