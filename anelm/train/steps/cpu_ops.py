"""The CPU half of a training step: norms, activations, RoPE, GQA, embedding, loss, dW.

Layout: every activation is channel-first `[C, S]`, float32, C-contiguous, which is the device's
`[1, C, 1, S]` surface without the unit axes, so nothing is transposed at the device boundary.
S is the number of positions in the step: one sequence, or B sequences side by side (B·S
columns; RoPE then takes the per-column positions). Weights keep PyTorch's orientation:
a linear weight is `[out, in]`, an embedding table `[V, D]`, a norm weight `[C]`.

Semantics are Hugging Face's Llama/Qwen3 (half-split rotate_half RoPE, plain residuals), not
maderix's interleaved RoPE or α-scaled residuals. Each op has a `*_flops` counter for the
metrics' `cpu_flops`: matmuls count 2·m·n·k, elementwise work counts one per arithmetic op
(exp, sqrt and division count one each, as the references do).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...errors import ShapeError
from ...models import layers
from ...models.names import has_head_norms
from .gemm import dw_into

F32 = np.float32


def _check_2d(name: str, x: np.ndarray, channels: int | None = None) -> None:
    if x.ndim != 2 or (channels is not None and x.shape[0] != channels):
        want = f"[{channels}, S]" if channels is not None else "[C, S]"
        raise ShapeError(f"{name}: expected a channel-first {want} array, got shape {list(x.shape)}")


# ---------------------------------------------------------------- RMSNorm (over channels)

def rmsnorm_fwd(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """y = x · rrms · w per column. x `[C, S]`, w `[C]` → (y `[C, S]`, rrms `[S]` kept for bwd)."""
    _check_2d("rmsnorm input", x, w.shape[0])
    # mean over channels in float32, as HF does even for fp16 models
    rrms = (F32(1.0) / np.sqrt(np.mean(x * x, axis=0) + F32(eps))).astype(F32)
    return x * rrms * w[:, None], rrms


def rmsnorm_bwd(dy: np.ndarray, x: np.ndarray, w: np.ndarray,
                rrms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of `rmsnorm_fwd`. dy, x `[C, S]` → (dx `[C, S]`, dw `[C]`).

    With x̂ = x·rrms and g = dy·w: dx = rrms·(g − x̂·mean_c(g·x̂)), dw = Σ_t dy·x̂.
    """
    _check_2d("rmsnorm grad", dy, x.shape[0])
    xhat = x * rrms
    dw = np.einsum("cs,cs->c", dy, xhat)
    g = dy * w[:, None]
    m = np.mean(g * xhat, axis=0)
    return rrms * (g - xhat * m), dw.astype(F32)


def rmsnorm_flops(c: int, s: int, backward: bool = False) -> int:
    return (8 if backward else 4) * c * s + 3 * s


# ------------------------------------------- Qwen3 q/k norm: RMSNorm over each head's dims

def head_rmsnorm_fwd(x: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-head RMSNorm of q or k. x `[H·hd, S]` (head h owns rows h·hd…h·hd+hd−1), w `[hd]`
    shared by all heads → (y `[H·hd, S]`, rrms `[H, 1, S]`)."""
    hd = w.shape[0]
    if x.ndim != 2 or x.shape[0] % hd:
        raise ShapeError(f"head norm: expected [H*{hd}, S], got shape {list(x.shape)}")
    x3 = x.reshape(-1, hd, x.shape[1])  # (H, hd, S)
    rrms = (F32(1.0) / np.sqrt(np.mean(x3 * x3, axis=1, keepdims=True) + F32(eps))).astype(F32)
    return (x3 * rrms * w[None, :, None]).reshape(x.shape), rrms


def head_rmsnorm_bwd(dy: np.ndarray, x: np.ndarray, w: np.ndarray,
                     rrms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of `head_rmsnorm_fwd`: (dx `[H·hd, S]`, dw `[hd]` summed over heads and S)."""
    hd = w.shape[0]
    x3 = x.reshape(-1, hd, x.shape[1])    # (H, hd, S)
    dy3 = dy.reshape(x3.shape)            # (H, hd, S)
    xhat = x3 * rrms
    dw = np.einsum("hds,hds->d", dy3, xhat)
    g = dy3 * w[None, :, None]
    m = np.mean(g * xhat, axis=1, keepdims=True)
    return (rrms * (g - xhat * m)).reshape(x.shape), dw.astype(F32)


# ------------------------------------------------------------------- SiLU and SwiGLU

def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of −x overflows to inf for x < −88, which still gives the right limit 0;
    # one buffer, updated in place: these run over every MLP activation of every layer
    e = np.negative(x, dtype=F32)
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    e += F32(1.0)
    return np.reciprocal(e, out=e)


def swiglu_bwd(dgate: np.ndarray, h1: np.ndarray, h3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dh1, dh3) from dgate `[H, S]`: dh1 = dgate·h3·silu'(h1), dh3 = dgate·silu(h1)."""
    s = _sigmoid(h1)
    dh3 = h1 * s
    dh3 *= dgate
    dh1 = np.subtract(F32(1.0), s)  # silu'(h1) = s·(1 + h1·(1 − s)), built in one buffer
    dh1 *= h1
    dh1 += F32(1.0)
    dh1 *= s
    dh1 *= h3
    dh1 *= dgate
    return dh1, dh3


def swiglu_flops(h: int, s: int, backward: bool = False) -> int:
    return (11 if backward else 6) * h * s


# ------------------------------------------------------- RoPE (HF half-split rotate_half)

def rope_tables(head_dim: int, positions: np.ndarray, theta: float,
                scaling: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables `[hd, S]` for the given column positions `[S]`: the models' tables
    (`models.layers`, HF's float32 frequencies and `scaling`), channel-first, each frequency
    in both halves (row i and row i + hd/2 hold the same angle)."""
    if head_dim % 2:
        raise ShapeError(f"rope: expected an even head_dim, got {head_dim}")
    cos, sin = layers.rope_tables(np.asarray(positions), layers.rope_inv_freq(head_dim, theta, scaling))
    return layers.rope_full_width(cos), layers.rope_full_width(sin)


def _rotate_half(x3: np.ndarray) -> np.ndarray:
    half = x3.shape[1] // 2
    return np.concatenate([-x3[:, half:], x3[:, :half]], axis=1)


def rope_fwd(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """y = x·cos + rotate_half(x)·sin per head. x `[H·hd, S]`, cos/sin `[hd, S]`."""
    hd = cos.shape[0]
    if x.ndim != 2 or x.shape[0] % hd or x.shape[1] != cos.shape[1]:
        raise ShapeError(f"rope: expected [H*{hd}, {cos.shape[1]}], got shape {list(x.shape)}")
    x3 = x.reshape(-1, hd, x.shape[1])  # (H, hd, S)
    return (x3 * cos + _rotate_half(x3) * sin).reshape(x.shape)


def rope_bwd(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Gradient through RoPE: the transposed rotation, i.e. RoPE by the negated angle.

    dx = dy·cos + Rᵀ(dy·sin), and Rᵀ(v·sin) = −R(v)·sin because sin repeats across halves.
    """
    return rope_fwd(dy, cos, -sin)


def rope_flops(c: int, s: int) -> int:
    return 4 * c * s


# ------------------------------------------------------------------------- embedding

def embed_fwd(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of the `[V, D]` table for ids `[S]`, returned channel-first `[D, S]`."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ShapeError(f"embedding: expected token ids in [0, {table.shape[0]}), "
                         f"got ids in [{ids.min()}, {ids.max()}]")
    return np.ascontiguousarray(table[ids].T)


def embed_bwd(dx: np.ndarray, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Scatter-add dx `[D, S]` into the table gradient `out` `[V, D]` (in place; returned).

    Repeated ids accumulate. Passing the classifier's dW as `out` gives the summed gradient
    of tied embeddings. Rows are sorted by id and summed per run with reduceat, then added
    once per distinct id: np.add.at over rows is ~50× slower.
    """
    _check_2d("embedding grad", dx, out.shape[1])
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        return out
    order = np.argsort(ids, kind="stable")
    sid = ids[order]
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])  # first row of each distinct id
    out[sid[starts]] += np.add.reduceat(dx.T[order], starts, axis=0)  # ids unique: no clash
    return out


def embed_flops(d: int, s: int, backward: bool = False) -> int:
    return d * s if backward else 0


# ------------------------------------------------------ linear maps and weight gradients


def dw(dy: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Weight gradient of y = W·x: dW = dy·xᵀ, `[out, in]` like the weight (PyTorch orientation).

    dy `[out, S]`, x `[in, S]`. With `out`, the product is added into it (accumulation over
    micro-batches) and `out` is returned.
    """
    if dy.shape[1] != x.shape[1]:
        raise ShapeError(f"dW: expected dy and x with the same S, got {list(dy.shape)} and {list(x.shape)}")
    g = dy @ x.T
    if out is None:
        return g
    out += g
    return out


def matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


# ---------------------------------------------------------------- classifier and loss

def classifier_fwd(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """logits `[V, S]` = W·x for the (tied or untied) output head W `[V, D]`, x `[D, S]`."""
    return w @ x


IGNORE = -100  # a target that is not counted (HF's ignore_index): a prompt token, padding


def cross_entropy(logits: np.ndarray, targets: np.ndarray,
                  scale: float = 1.0, count: int | None = None) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over the counted positions, and its scaled gradient.

    logits `[V, N]`, targets `[N]`; a target IGNORE adds no loss and gets no gradient.
    Returns (loss, dlogits `[V, N]` = (softmax − onehot)/count · scale). The loss is unscaled;
    `scale` is the loss scale, applied here once so fp16 gradients stay above underflow.
    `count`: the counted targets the mean is over (default: this call's); more when these N
    are a chunk of them (`head_loss`) or one micro-batch of a step's (the trainer).
    """
    _check_2d("logits", logits)
    t = np.asarray(targets).reshape(-1)
    v, n = logits.shape
    keep = t != IGNORE
    tk = np.where(keep, t, 0)
    if t.shape[0] != n or (n and (tk.min() < 0 or tk.max() >= v)):
        raise ShapeError(f"cross entropy: expected {n} targets in [0, {v}) or {IGNORE}, got {t.shape[0]}")
    cols = np.arange(n)
    mx = logits.max(axis=0)           # (N,)
    p = logits - mx                   # (V, N), shifted for a stable exp
    np.exp(p, out=p)
    z = p.sum(axis=0)                 # (N,)
    # loss = log z − (logit[t] − max), read from the logits, not from log(softmax)
    total = int(keep.sum()) if count is None else count
    each = np.log(z) - (logits[tk, cols] - mx)
    loss = float(np.sum(each[keep], dtype=np.float64) / max(total, 1))
    p *= (F32(scale) / F32(max(total, 1))) / z
    p[tk, cols] -= F32(scale) / F32(max(total, 1))
    if not keep.all():
        p[:, ~keep] = 0
    return loss, p


HEAD_CHUNK = 1 << 23  # logits per chunk of `head_loss`: 32 MiB of float32


def head_loss(head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float = 1.0,
              want_dw: bool = True, count: int | None = None, out: np.ndarray | None = None,
              add: bool = False) -> tuple[float, np.ndarray, Callable[[], np.ndarray] | None]:
    """The classifier and the mean cross-entropy over the counted positions (`count`, as
    `cross_entropy`): head W `[V, D]`, xf `[D, N]`, targets `[N]` -> (loss, dxf `[D, N]`, a call
    giving dW `[V, D]`, or None without `want_dw`), each gradient times `scale` (the loss scale).
    `out`: dW is written into it (`add` False) or added to it by the GEMM (`gemm.dw_into`).

    Past HEAD_CHUNK logits (Gemma 3: 262,144 × N floats, 1 GiB at N = 1024) it runs in chunks
    of positions, so the logits and their gradient never exist whole, and dW accumulates chunk
    by chunk. Below it, one chunk: dW = dlogits·xfᵀ is left to the call, which the step runs
    on its dW worker while the backward goes on."""
    v, n = head.shape[0], xf.shape[1]
    t = np.asarray(targets).reshape(-1)
    step = max(1, HEAD_CHUNK // v)
    count = int((t != IGNORE).sum()) if count is None else count
    if step >= n:
        loss, dlog = cross_entropy(classifier_fwd(head, xf), t, scale, count)
        dw_call = (lambda: dw(dlog, xf)) if out is None else (lambda: dw_into(out, dlog, xf, add))
        return loss, head.T @ dlog, dw_call if want_dw else None
    loss, dxf = 0.0, np.empty_like(xf)
    acc = (np.zeros_like(head) if out is None else out) if want_dw else None
    for lo in range(0, n, step):
        cols = slice(lo, min(n, lo + step))
        part, dlog = cross_entropy(classifier_fwd(head, xf[:, cols]), t[cols], scale, count)
        loss += part
        dxf[:, cols] = head.T @ dlog
        if acc is not None:
            dw_into(acc, dlog, xf[:, cols], add or lo > 0 or out is None)
    return loss, dxf, (lambda: acc) if want_dw else None


def cross_entropy_flops(v: int, n: int) -> int:
    return 6 * v * n


def cpu_step_flops(cfg: dict, n_tokens: int, rope_on_cpu: bool = True) -> int:
    """CPU arithmetic of one training step over `n_tokens` positions, for `cpu_flops`.

    Counts what the split in the issue leaves on the CPU: embedding backward, both RMSNorms
    and the final one (forward and backward), residual adds, SwiGLU backward, RoPE inverse on
    dq/dk (unless the kernels do it), the classifier forward and backward, the loss, and every
    dW. The dK/dV sums over each KV head's query group are not here: `sdpa_bwd` does them on
    the device. AdamW is `optim.adamw_flops`, counted once per optimizer step.
    """
    d, inter, n = cfg["hidden_size"], cfg["intermediate_size"], n_tokens
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or hq
    hd = cfg.get("head_dim") or d // hq
    q_dim, kv_dim = hq * hd, hkv * hd
    per_layer = (2 * (rmsnorm_flops(d, n) + rmsnorm_flops(d, n, backward=True))
                 + 4 * d * n                                     # residual adds, fwd and bwd
                 + swiglu_flops(inter, n, backward=True)
                 + (rope_flops(q_dim + kv_dim, n) if rope_on_cpu else 0)
                 + matmul_flops(d, n, 2 * q_dim + 2 * kv_dim)    # dWq, dWk, dWv, dWo
                 + matmul_flops(d, n, 3 * inter))                # dW gate, up, down
    if has_head_norms(cfg.get("model_type")):                    # q/k norm backward
        per_layer += rmsnorm_flops(q_dim + kv_dim, n, backward=True)
    v = cfg["vocab_size"]
    head = (3 * matmul_flops(v, d, n) + cross_entropy_flops(v, n)
            + rmsnorm_flops(d, n) + rmsnorm_flops(d, n, backward=True) + embed_flops(d, n, True))
    return cfg["num_hidden_layers"] * per_layer + head


# --------------------------------------------- GPT-2: LayerNorm over channels, tanh GELU

def layernorm_fwd(x: np.ndarray, w: np.ndarray, b: np.ndarray,
                  eps: float) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """y = x̂·w + b per column, x̂ = (x − mean)/√(var + eps) (biased var, as torch) → (y, (x̂, rstd))."""
    _check_2d("layernorm input", x, w.shape[0])
    xc = x - x.mean(axis=0)
    rstd = (F32(1.0) / np.sqrt(np.mean(xc * xc, axis=0) + F32(eps))).astype(F32)
    xhat = xc * rstd
    return xhat * w[:, None] + b[:, None], (xhat, rstd)


def layernorm_bwd(dy: np.ndarray, saved: tuple[np.ndarray, np.ndarray],
                  w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dw, db): with g = dy·w, dx = rstd·(g − mean_c(g) − x̂·mean_c(g·x̂))."""
    xhat, rstd = saved
    g = dy * w[:, None]
    dx = rstd * (g - g.mean(axis=0) - xhat * np.mean(g * xhat, axis=0))
    return dx, np.einsum("cs,cs->c", dy, xhat).astype(F32), dy.sum(axis=1, dtype=F32)


def gelu_tanh_bwd(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """d/dx of 0.5·x·(1 + tanh(u)), u = c·(x + 0.044715·x³), c = √(2/π) (GPT-2's gelu_new)."""
    c, k = F32(np.sqrt(2.0 / np.pi)), F32(0.044715)
    t = np.tanh(c * (x + k * x * x * x))
    return dy * (F32(0.5) * (F32(1.0) + t) + F32(0.5) * x * (F32(1.0) - t * t) * c * (F32(1.0) + F32(3.0) * k * x * x))


def gelu_gated_bwd(dgate: np.ndarray, h1: np.ndarray, h3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of gate = gelu_tanh(h1)·h3 (Gemma's MLP): (dh1, dh3)."""
    return gelu_tanh_bwd(dgate * h3, h1), dgate * layers.gelu_tanh(h1)
