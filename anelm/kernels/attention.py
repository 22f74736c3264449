"""Attention pieces shared by the inference and training kernels, in forms `strict` takes.

Heads live in a rank-4 layout `[Hkv, G, Dh, S]` (G = query heads per KV head): the query
projection `[1, H·Dh, 1, S]` reshapes to it directly because query head h = kv·G + g uses KV
head kv = h // G (HF's GQA mapping), and K/V reshape to `[Hkv, 1, Dh, S]` so matmul
broadcasts them over G. No tiling, no concat.

The causal mask is an additive const (hardware SDPA ignores masks, strict §2.5); −1e4 rather
than −65504 so that `score + mask` cannot overflow fp16 to −inf (ml-ane-transformers).
"""

from __future__ import annotations

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Value

MASK_VALUE = -1e4


def causal_mask(seq: int, keys: int | None = None, offset: int = 0, window: int | None = None) -> np.ndarray:
    """[1, 1, S, T] additive mask: query i (at position offset+i) may see keys j ≤ offset+i, and
    with a sliding `window` only those with j > offset+i − window (HF's rule)."""
    keys = seq if keys is None else keys
    q = np.arange(seq)[:, None] + offset
    k = np.arange(keys)[None, :]
    seen = (k <= q) if window is None else (k <= q) & (k > q - window)
    return np.where(seen, 0.0, MASK_VALUE).astype(np.float32)[None, None]


def split_heads(b: GraphBuilder, x: Value, heads: int, groups: int, head_dim: int, name: str) -> Value:
    """[1, heads·groups·Dh, 1, S] -> [heads, groups, Dh, S]."""
    s = x.shape[3]
    return b.reshape(x, [heads, groups, head_dim, s], name=name)
