"""CPU pieces of a Llama training step that the package does not run, kept as references for
the tests: the forward linears and SwiGLU gate (the device kernels compute them), the GQA
expansion and its transpose (the attention kernels broadcast and sum over each group on the
device), and the classifier's dx (folded into the head's backward in `train/steps/llama.py`).

They use `anelm.train.steps.cpu_ops`' layout: channel-first `[C, S]` float32, weights `[out, in]`.
"""

import numpy as np

from anelm.errors import ShapeError

F32 = np.float32


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return F32(1.0) / (F32(1.0) + np.exp(-x))


def silu_fwd(x: np.ndarray) -> np.ndarray:
    """silu(x) = x·σ(x), elementwise, any shape."""
    return x * _sigmoid(x)


def silu_bwd(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """d silu/dx = σ(x)·(1 + x·(1 − σ(x))), elementwise."""
    s = _sigmoid(x)
    return dy * s * (F32(1.0) + x * (F32(1.0) - s))


def swiglu_fwd(h1: np.ndarray, h3: np.ndarray) -> np.ndarray:
    """gate = silu(h1)·h3. h1 = W1·x (gate_proj), h3 = W3·x (up_proj), both `[H, S]`."""
    return silu_fwd(h1) * h3


def gqa_expand(kv: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """K or V `[Hkv·hd, S]` → `[Hq·hd, S]`; query head h reads KV head h // (Hq/Hkv), as HF's
    repeat_kv (repeat-interleave) does."""
    n_kv = kv.shape[0] // head_dim
    if n_kv * head_dim != kv.shape[0] or n_heads % n_kv:
        raise ShapeError(f"gqa: expected [Hkv*{head_dim}, S] with Hkv dividing {n_heads}, "
                         f"got shape {list(kv.shape)}")
    kv4 = kv.reshape(n_kv, 1, head_dim, kv.shape[1])  # (Hkv, 1, hd, S)
    full = np.broadcast_to(kv4, (n_kv, n_heads // n_kv, head_dim, kv.shape[1]))
    return full.reshape(n_heads * head_dim, kv.shape[1])  # (Hq·hd, S), a copy


def gqa_reduce(dkv_full: np.ndarray, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """Transpose of `gqa_expand`: `[Hq·hd, S]` → `[Hkv·hd, S]`, summing each group's heads."""
    s = dkv_full.shape[1]
    group = dkv_full.shape[0] // (n_kv_heads * head_dim)
    if group * n_kv_heads * head_dim != dkv_full.shape[0]:
        raise ShapeError(f"gqa: expected [Hq*{head_dim}, S] with Hq a multiple of {n_kv_heads}, "
                         f"got shape {list(dkv_full.shape)}")
    g4 = dkv_full.reshape(n_kv_heads, group, head_dim, s)  # (Hkv, group, hd, S)
    return g4.sum(axis=1).reshape(n_kv_heads * head_dim, s)


def linear_fwd(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = W·x: W `[out, in]`, x `[in, S]` → `[out, S]` (a 1×1 conv in device terms)."""
    return w @ x


def linear_dx(w: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dx = Wᵀ·dy: dy `[out, S]` → `[in, S]`."""
    return w.T @ dy


def classifier_bwd(dlogits: np.ndarray, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dx `[D, S]`, dW `[V, D]`). For tied embeddings add `embed_bwd` into this dW."""
    return w.T @ dlogits, dlogits @ x.T
