"""maderix's dynamic training kernels as they are (maderix/ANE, training/training_dynamic/), built as graphs.

The end-to-end figures of maderix's dynamic pipeline are predicted for its own ten programs,
not ours: the same packing (one fp16 input `[1, IC, 1, S + Σ OC]`, weights in the columns after
the activations), the same in-kernel work (maderix's "dynamic matmul" with its reshapes and
transposes, RoPE on Q and K, the GQA tile of K and V by a head concat, the causal mask,
softmax, the concat of every output on the channel axis) and the same outputs. The weights of
each kernel are data, so one compile serves every layer; the shapes are the model's.

    kernel       input channels x columns          outputs (concat order)
    sdpaFwd      D x (S + Q + 2KV)                 attn Q, q_rope Q, k_rope KV, v KV, xnorm D
    woFwd        Q x (S + D)                       o D
    ffnFused     D x (2S + 3H)                     x_next D, h1 H, h3 H, gate H
    ffnBwdW2t    D x (S + H)                       dgate H
    ffnBwdW13t   H x (2S + 2D)                     dx D
    wotBwd       D x (S + Q)                       da Q
    sdpaBwd1     4Q x S                            dv Q, probs Hq·S, dp Hq·S
    sdpaBwd2     (2·Hq·S + 2Q) x S                 dq Q, dk Q
    qBwd         Q x (S + D)                       dx D
    kvBwd        KV x (2S + 2D)                    dx D
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..chip.profile import STRICT
from ..ir.builder import GraphBuilder

# maderix's programs run on the in-memory path, where concat compiles (maderix's MIL emits it, and
# ANEForge's MIL vocabulary sweep finds it reachable and correct); the strict profile rejects it,
# so these compile under a profile that allows it, and with the widths those measured programs ran
# at (ANEForge's row reductions return 1 column)
IN_MEMORY = replace(STRICT, name="in-memory", rejected_ops=(), spatial_multiple_of=1)
FORWARD = ("sdpaFwd", "woFwd", "ffnFused")
BACKWARD = ("ffnBwdW2t", "ffnBwdW13t", "wotBwd", "sdpaBwd1", "sdpaBwd2", "qBwd", "kvBwd")
KERNELS = FORWARD + BACKWARD


def _dyn_matmul(b, x, ic: int, s: int, act_col: int, w_col: int, oc: int, name: str):
    """y `[1, OC, 1, S]` = Wᵀ·act for W `[IC, OC]` packed beside act in x (maderix's dynamic matmul)."""
    act = b.slice_by_size(x, [0, 0, 0, act_col], [1, ic, 1, s], name=f"{name}_a")
    return times_packed_weight(b, act, x, ic, s, w_col, oc, name)


def times_packed_weight(b, act, x, ic: int, s: int, w_col: int, oc: int, name: str):
    """y `[1, OC, 1, S]` = Wᵀ·act for an activation `[1, IC, 1, S]` and W `[IC, OC]` in x's columns."""
    w = b.slice_by_size(x, [0, 0, 0, w_col], [1, ic, 1, oc], name=f"{name}_w")
    act = b.transpose(b.reshape(act, [1, 1, ic, s], name=f"{name}_ar"), [0, 1, 3, 2], name=f"{name}_at")  # (1,1,S,IC)
    w = b.reshape(w, [1, 1, ic, oc], name=f"{name}_wr")                                                    # (1,1,IC,OC)
    y = b.matmul(act, w, name=f"{name}_mm")                                                                # (1,1,S,OC)
    return b.reshape(b.transpose(y, [0, 1, 3, 2], name=f"{name}_yt"), [1, oc, 1, s], name=name)


def _heads(b, x, h: int, hd: int, s: int, name: str):
    """`[1, h·HD, 1, S]` -> `[1, h, S, HD]` (heads on axis 1, as the kernels lay them out)."""
    return b.transpose(b.reshape(x, [1, h, hd, s], name=f"{name}_r"), [0, 1, 3, 2], name=name)


def _flat(b, x, h: int, hd: int, s: int, name: str):
    """`[1, h, S, HD]` -> `[1, h·HD, 1, S]`."""
    return b.reshape(b.transpose(x, [0, 1, 3, 2], name=f"{name}_t"), [1, h * hd, 1, s], name=name)


def _rope(b, x, cos, sin, h: int, hd: int, s: int, name: str):
    """out = x·cos + rotate_half(x)·sin on adjacent pairs (maderix's train.m): reshape, slice, negate, concat."""
    pairs = b.reshape(x, [1, h, s * hd // 2, 2], name=f"{name}_p")
    even = b.slice_by_size(pairs, [0, 0, 0, 0], [1, h, s * hd // 2, 1], name=f"{name}_e")
    odd = b.slice_by_size(pairs, [0, 0, 0, 1], [1, h, s * hd // 2, 1], name=f"{name}_o")
    rot = b.concat([b.mul(odd, b.scalar(-1.0), name=f"{name}_n"), even], axis=3, name=f"{name}_c")
    rot = b.reshape(rot, [1, h, s, hd], name=f"{name}_rr")
    return b.add(b.mul(x, cos, name=f"{name}_xc"), b.mul(rot, sin, name=f"{name}_rs"), name=name)


def _tile(b, x, ratio: int, name: str):
    """GQA: the whole K (or V) block repeated `ratio` times along the head axis, as maderix's
    kernel tiles it."""
    return x if ratio == 1 else b.concat([x] * ratio, axis=1, name=name)


def _scores(b, q, k, mask, hd: int, name: str):
    """softmax(Q·Kᵀ/√HD + causal mask) `[1, Hq, S, S]`."""
    sc = b.mul(b.matmul(q, k, transpose_y=True, name=f"{name}_qk"), b.scalar(1 / np.sqrt(hd)), name=f"{name}_s")
    return b.softmax(b.add(sc, mask, name=f"{name}_m"), axis=-1, name=name)


def _consts(b, s: int, hd: int):
    mask = np.triu(np.full((s, s), -65504.0, np.float32), 1).reshape(1, 1, s, s)
    table = np.zeros((1, 1, s, hd), np.float32)
    return b.weight("mask", mask), b.weight("cos", table), b.weight("sin", table)


def packed_input(b, shape, io_dtype: str = "fp16"):
    """The one input `x`; an fp32 surface is cast to fp16 on entry, as in maderix's benchmarks."""
    x = b.input("x", shape, io_dtype)
    return x if io_dtype == "fp16" else b.cast(x, "fp16", name="x16")


def packed_output(b, outs, io_dtype: str = "fp16"):
    """Every result concatenated on the channel axis into `out`, cast back for an fp32 surface."""
    out = outs[0] if len(outs) == 1 else b.concat(outs, axis=1, name="cat")
    b.output("out", out if io_dtype == "fp16" else b.cast(out, "fp32", name="out32"))
    return b.build()


def build(kind: str, d: int, f: int, hq: int, hkv: int, hd: int, s: int, layers: int, io_dtype: str = "fp16"):
    """The graph of maderix kernel `kind` at these shapes; `io_dtype` "fp32": its surfaces are
    fp32, as in the first dynamic version's weight-bearing kernels (bench/maderix_v1.py)."""
    q, kv, sc, alpha = hq * hd, hkv * hd, hq * s, 1 / np.sqrt(2 * layers)
    b = GraphBuilder(kind)

    def inp(shape):
        return packed_input(b, shape, io_dtype)

    if kind == "sdpaFwd":
        x = inp([1, d, 1, s + q + 2 * kv])
        mask, cos, sin = _consts(b, s, hd)
        qq = _dyn_matmul(b, x, d, s, 0, s, q, "q")
        kk = _dyn_matmul(b, x, d, s, 0, s + q, kv, "k")
        vv = _dyn_matmul(b, x, d, s, 0, s + q + kv, kv, "v")
        qr = _rope(b, _heads(b, qq, hq, hd, s, "qh"), cos, sin, hq, hd, s, "qr")
        kr = _rope(b, _heads(b, kk, hkv, hd, s, "kh"), cos, sin, hkv, hd, s, "kr")
        vh = _heads(b, vv, hkv, hd, s, "vh")
        p = _scores(b, qr, _tile(b, kr, hq // hkv, "kt"), mask, hd, "p")
        att = b.matmul(p, _tile(b, vh, hq // hkv, "vt"), name="pv")
        xn = b.slice_by_size(x, [0, 0, 0, 0], [1, d, 1, s], name="xn")
        outs = [_flat(b, att, hq, hd, s, "attn"), _flat(b, qr, hq, hd, s, "qro"), _flat(b, kr, hkv, hd, s, "kro"), vv, xn]
    elif kind in ("woFwd", "qBwd"):
        x = inp([1, q, 1, s + d])
        outs = [_dyn_matmul(b, x, q, s, 0, s, d, "y")]
    elif kind == "ffnFused":
        x = inp([1, d, 1, 2 * s + 3 * f])
        h1 = _dyn_matmul(b, x, d, s, 0, 2 * s, f, "h1")
        h3 = _dyn_matmul(b, x, d, s, 0, 2 * s + f, f, "h3")
        gate = b.mul(b.mul(h1, b.sigmoid(h1, name="sg"), name="silu"), h3, name="gate")
        w2 = b.reshape(b.slice_by_size(x, [0, 0, 0, 2 * s + 2 * f], [1, d, 1, f], name="w2"), [1, 1, d, f], name="w2r")
        w2t = b.transpose(w2, [0, 1, 3, 2], name="w2t")                                  # (1,1,H,D)
        g = b.transpose(b.reshape(gate, [1, 1, f, s], name="gr"), [0, 1, 3, 2], name="gt")  # (1,1,S,H)
        ffn = b.reshape(b.transpose(b.matmul(g, w2t, name="ffn_mm"), [0, 1, 3, 2], name="ft"), [1, d, 1, s], name="ffn")
        x2 = b.slice_by_size(x, [0, 0, 0, s], [1, d, 1, s], name="x2")
        outs = [b.add(x2, b.mul(ffn, b.scalar(alpha), name="af"), name="xnext"), h1, h3, gate]
    elif kind == "ffnBwdW2t":
        x = inp([1, d, 1, s + f])
        outs = [_dyn_matmul(b, x, d, s, 0, s, f, "dgate")]
    elif kind in ("ffnBwdW13t", "kvBwd"):
        ic = f if kind == "ffnBwdW13t" else kv
        x = inp([1, ic, 1, 2 * s + 2 * d])
        outs = [b.add(_dyn_matmul(b, x, ic, s, 0, 2 * s, d, "a"), _dyn_matmul(b, x, ic, s, s, 2 * s + d, d, "b"), name="dx")]
    elif kind == "wotBwd":
        x = inp([1, d, 1, s + q])
        outs = [_dyn_matmul(b, x, d, s, 0, s, q, "da")]
    elif kind == "sdpaBwd1":
        x = inp([1, 4 * q, 1, s])
        mask, _, _ = _consts(b, s, hd)
        qh, kh, vh, dah = (_heads(b, b.slice_by_size(x, [0, i * q, 0, 0], [1, q, 1, s], name=f"in{i}"), hq, hd, s, f"h{i}")
                           for i in range(4))
        p = _scores(b, qh, kh, mask, hd, "p")
        dv = b.matmul(p, dah, transpose_x=True, name="dv")
        dp = b.matmul(dah, vh, transpose_y=True, name="dp")
        outs = [_flat(b, dv, hq, hd, s, "dvo"), b.reshape(p, [1, sc, 1, s], name="po"), b.reshape(dp, [1, sc, 1, s], name="dpo")]
    elif kind == "sdpaBwd2":
        x = inp([1, 2 * sc + 2 * q, 1, s])
        p = b.reshape(b.slice_by_size(x, [0, 0, 0, 0], [1, sc, 1, s], name="pi"), [1, hq, s, s], name="p")
        dp = b.reshape(b.slice_by_size(x, [0, sc, 0, 0], [1, sc, 1, s], name="dpi"), [1, hq, s, s], name="dp")
        qh, kh = (_heads(b, b.slice_by_size(x, [0, 2 * sc + i * q, 0, 0], [1, q, 1, s], name=f"in{i}"), hq, hd, s, f"h{i}")
                  for i in range(2))
        row = b.reduce_sum(b.mul(p, dp, name="pdp"), axes=(-1,), name="row")
        ds = b.mul(b.mul(p, b.sub(dp, row, name="c"), name="ds0"), b.scalar(1 / np.sqrt(hd)), name="ds")
        outs = [_flat(b, b.matmul(ds, kh, name="dq"), hq, hd, s, "dqo"),
                _flat(b, b.matmul(ds, qh, transpose_x=True, name="dk"), hq, hd, s, "dko")]
    else:
        raise ValueError(f"unknown maderix kernel {kind!r}; expected one of {', '.join(KERNELS)}")
    return packed_output(b, outs, io_dtype)


def io_elements(kind: str, d: int, f: int, hq: int, hkv: int, hd: int, s: int) -> tuple[int, int, int]:
    """(activation elements the host writes, result elements it reads, weight elements staged)
    per evaluation. sdpaBwd1's probs and dp reach sdpaBwd2 by a surface-to-surface copy (maderix's
    train.m), counted as written there; Q and K_tiled are written from the CPU into both."""
    q, kv, sc = hq * hd, hkv * hd, hq * s
    table = {"sdpaFwd": (d * s, (2 * q + 2 * kv + d) * s, d * (q + 2 * kv)),
             "woFwd": (q * s, d * s, q * d), "ffnFused": (2 * d * s, (d + 3 * f) * s, 3 * d * f),
             "ffnBwdW2t": (d * s, f * s, d * f), "ffnBwdW13t": (2 * f * s, d * s, 2 * f * d),
             "wotBwd": (d * s, q * s, d * q), "sdpaBwd1": (4 * q * s, (q + 2 * sc) * s, 0),
             "sdpaBwd2": ((2 * sc + 2 * q) * s, 2 * q * s, 0), "qBwd": (q * s, d * s, q * d),
             "kvBwd": (2 * kv * s, d * s, 2 * kv * d)}
    return table[kind]
