"""Causal attention forward and backward kernels for training (no weights).

Heads use the inference kernels' layout (`anelm.kernels.attention`): queries `[Hkv, G, hd, S]`
(query head h = kv·G + g reads KV head kv = h // G, HF's GQA mapping), keys and values
`[Hkv, 1, hd, S]`, broadcast over G by matmul, so GQA needs no tiling and no concat. The
additive causal mask is a const (hardware SDPA ignores masks), or with
`Dims.mask_input` an input `[1, S_q, 1, S_k]` the CPU writes per sequence (packed examples see
only their own tokens). q and k arrive after RoPE (`qr`, `kr`: the CPU rotated them), or with
`Dims.rope` before it, with the tables in an input `rope` (cos, then sin, `[hd, S]` at HF's full
width): the forward rotates them as the inference kernels do (`layers.apply_rope`), the backward
rotates them again to recompute the probabilities and takes the inverse rotation of its dq, dk
(a rotation's inverse is its transpose: dx = dy·cos + Pᵀ·(dy·sin), P the half-turn), so the
CPU neither rotates q and k nor turns their gradients back.

With P the probabilities `[Hkv, G, S_q, S_k]`, dO the attention-output gradient `[.., hd, S_q]`:
    dP  = dOᵀ·V                          dV = Σ_G dO·P
    dS  = P ∘ (dP − rowsum(P ∘ dP)) · scale      (scale 1/√hd, or the family's: Gemma's)
    dQ  = K·dSᵀ                          dK = Σ_G Q·dS
The sums over a KV head's G query heads are the contraction of one matmul each (`_grouped`:
dO and Q as `[hd, G·S_q]`, P and dS as `[G·S_q, S_k]`), not a reduction after G matmuls: the
device's reductions run on its slow vector path, its matmuls on the fast one. For the same
reason rowsum(P ∘ dP) is a matmul by a column of ones.
With `Dims.carry_probs` the forward also returns P and the backward takes it as an input
`probs` `[Hq·S_q, 1, S_k]`; else the backward recomputes it from q and k. P is S² per head, far
larger than q and k, but recomputing costs a matmul and a softmax on the device's slow vector
path, more than P's way through the host at S 256 (the trainer carries it while the host can
keep it: `training_layout.carry_fits`).
"""

from __future__ import annotations

import numpy as np

from ..ir.graph import Value
from .attention import causal_mask, split_heads
from .layers import apply_rope, rotate_half_matrix


def _heads(k, name: str, groups: int) -> Value:
    """Input `name` `[1, H·hd, 1, S]` -> `[Hkv, groups, hd, S]`."""
    m = k.m
    return split_heads(k.b, k.act(name), m.hkv, groups, m.hd, f"{name}_h")


def _rope(k) -> tuple[Value, Value, Value] | None:
    """cos, sin `[1, 1, hd, S]` (broadcast over the heads) and the half-turn P `[1, 1, hd, hd]`,
    where the kernel rotates (`Dims.rope`); else None."""
    if not k.m.rope:
        return None
    b, m = k.b, k.m
    cos, sin = (b.reshape(k.act(n), [1, 1, m.hd, m.s], name=f"{n}_b") for n in ("cos", "sin"))
    return cos, sin, b.const(rotate_half_matrix(m.hd), name="rotate_half", dtype="fp16", blob=True)


def _rotated(k, name: str, groups: int, rope: tuple | None) -> Value:
    """Input `name` as heads, rotated by RoPE where the kernel rotates."""
    x = _heads(k, name, groups)
    return x if rope is None else apply_rope(k.b, x, *rope, f"{name}_rope")


def _probs(k, qh: Value, kh: Value) -> Value:
    """softmax(qᵀk·scale + mask) over keys: `[Hkv, G, S, S]` (causal, within the window if any)."""
    b, m = k.b, k.m
    sc = b.matmul(qh, kh, transpose_x=True, name="scores")            # [Hkv, G, S_q, S_k]
    scaled = b.mul(sc, m.scale, name="scaled")
    if m.mask_input:
        mask = b.reshape(k.act("mask"), [1, 1, m.s, m.s], name="mask")  # [1, S_q, 1, S_k] -> [1, 1, S_q, S_k]
    else:
        mask = b.const(causal_mask(m.s, window=m.window), name="mask", dtype="fp16", blob=True)  # [1, 1, S, S]
    return b.softmax(b.add(scaled, mask, name="masked"), axis=-1, name="softmax")


def _flat(k, x: Value, channels: int, name: str) -> Value:
    return k.b.reshape(x, [1, channels, 1, k.m.s], name=name)          # [1, C, 1, S]


def _grouped(k, x: Value, y: Value, name: str) -> Value:
    """Σ_G x_g·y_g as one matmul: x `[Hkv, G, hd, S_q]`, y `[Hkv, G, S_q, S_k]` -> `[Hkv, 1, hd, S_k]`
    (x's query heads side by side along S_q, y's stacked: the sum is the contraction)."""
    b, m = k.b, k.m
    g = m.hq // m.hkv
    if g > 1:
        x = b.reshape(b.transpose(x, [0, 2, 1, 3], name=f"{name}_t"), [m.hkv, 1, m.hd, g * m.s], name=f"{name}_x")
        y = b.reshape(y, [m.hkv, 1, g * m.s, m.s], name=f"{name}_y")
    return b.matmul(x, y, name=name)


def sdpa_fwd(k) -> dict[str, Value]:
    m, b = k.m, k.b
    g = m.hq // m.hkv
    rope = _rope(k)
    qh, kh, vh = _rotated(k, "qr", g, rope), _rotated(k, "kr", 1, rope), _heads(k, "v", 1)
    p = _probs(k, qh, kh)
    ot = b.matmul(vh, p, transpose_y=True, name="pv")                  # [Hkv, G, hd, S_q]
    out = {"attn": _flat(k, ot, m.q, "attn_out")}
    if m.carry_probs:
        out["probs"] = b.reshape(p, [1, m.hq * m.s, 1, m.s], name="probs_out")
    return out


def sdpa_bwd(k) -> dict[str, Value]:
    m, b = k.m, k.b
    g = m.hq // m.hkv
    rope = _rope(k)
    qh, kh, vh = _rotated(k, "qr", g, rope), _rotated(k, "kr", 1, rope), _heads(k, "v", 1)
    do = _heads(k, "dattn", g)                                         # [Hkv, G, hd, S_q]
    p = b.reshape(k.act("probs"), [m.hkv, g, m.s, m.s], name="probs_h") if m.carry_probs else _probs(k, qh, kh)
    dp = b.matmul(do, vh, transpose_x=True, name="dp")                 # [Hkv, G, S_q, S_k]
    dv = _grouped(k, do, p, "dv_sum")                                  # [Hkv, 1, hd, S_k]
    ones = b.const(np.ones((m.hkv, g, m.s, 1)), name="ones_k", dtype="fp16", blob=True)
    rowdot = b.matmul(b.mul(p, dp, name="pdp"), ones, name="rowdot")  # [Hkv, G, S_q, 1]: Σ over keys
    centered = b.sub(dp, rowdot, name="dp_c")
    ds = b.mul(b.mul(p, centered, name="ds_raw"), m.scale, name="ds")
    dq = b.matmul(kh, ds, transpose_y=True, name="dq_h")               # [Hkv, G, hd, S_q]
    dk = _grouped(k, qh, ds, "dk_sum")                                 # [Hkv, 1, hd, S_k]
    if rope is not None:  # the gradients of q and k before their rotation: by Pᵀ, the inverse turn
        cos, sin, _ = rope
        back = b.const(np.ascontiguousarray(rotate_half_matrix(m.hd).transpose(0, 1, 3, 2)), name="rotate_back",
                       dtype="fp16", blob=True)
        dq, dk = (apply_rope(b, d, cos, sin, back, f"{n}_unrope") for d, n in ((dq, "dq"), (dk, "dk")))
    return {"dk": _flat(k, dk, m.kv, "dk_out"), "dq": _flat(k, dq, m.q, "dq_out"),
            "dv": _flat(k, dv, m.kv, "dv_out")}
