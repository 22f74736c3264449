"""Attention pieces shared by the inference and training kernels, in forms `strict` takes.

Heads live in a rank-4 layout `[Hkv, G, Dh, S]` (G = query heads per KV head): the query
projection `[1, H·Dh, 1, S]` reshapes to it directly because query head h = kv·G + g uses KV
head kv = h // G (HF's GQA mapping), and K/V reshape to `[Hkv, 1, Dh, S]` so matmul
broadcasts them over G. No tiling, no concat.

The causal mask is an additive const (hardware SDPA ignores masks); −1e4 rather than −65504
so that `score + mask` cannot overflow fp16 to −inf (ml-ane-transformers).
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


def example_mask(positions: np.ndarray, width: int | None = None, window: int | None = None) -> np.ndarray:
    """`[W, W]` additive mask of one packed sequence: query i sees key j when both are in the same
    example (an example starts where its position is 0), j ≤ i, and with a sliding `window`,
    position_i − position_j < window. Columns past the S positions (a kernel's padding to
    `width`) are never seen by real queries; padding queries see keys causally, as with the
    const mask, so every row has a key and stays finite."""
    pos = np.asarray(positions).reshape(-1)
    s = len(pos)
    width = s if width is None else width
    seg = np.cumsum(pos == 0)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    seen = (seg[:, None] == seg[None, :]) & (j <= i)
    if window is not None:
        seen &= pos[:, None] - pos[None, :] < window
    out = np.where(np.tril(np.ones((width, width), bool)), 0.0, MASK_VALUE).astype(np.float32)
    out[:s, :s] = np.where(seen, 0.0, MASK_VALUE)
    return out


def split_heads(b: GraphBuilder, x: Value, heads: int, groups: int, head_dim: int, name: str) -> Value:
    """[1, heads·groups·Dh, 1, S] -> [heads, groups, Dh, S]."""
    s = x.shape[3]
    return b.reshape(x, [heads, groups, head_dim, s], name=name)
