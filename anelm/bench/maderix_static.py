"""The six baked programs per layer of maderix's static pipeline (maderix/ANE training/stories_mil.h,
train_large.m), which Orion's Stories trainer runs too (mechramc/Orion kernels/training/), built as graphs.

Weights are conv consts (1×1 conv on `[1, C, 1, S]`), so every layer is its own compile; the
RMSNorms of the forward, the SwiGLU backward and Woᵀ run inside the programs, and there is no
RoPE. What stays on the CPU: the embedding, residual adds, the classifier and cross-entropy,
both RMSNorm backwards, every dW and the optimizer (step_model.py reads that from StepSpec).

    kernel     input channels            outputs (concat order)
    fwdAttn    x D (pre-norm)            o D, Q D, K D, V D, attn D, xnorm D
    fwdFFN     x2 D (pre-norm)           ffn D, h1 H, h3 H, gate H, x2norm D
    ffnBwd     dffn D, h1 H, h3 H        dx D, dh1 H, dh3 H
    sdpaBwd1   Q, K, V, dx2 (4D)         dV D, probs Hq·S, dp Hq·S   (Woᵀ·dx2 inside)
    sdpaBwd2   probs, dp, Q, K           dQ D, dK D                   (no weights)
    qkvBwd     dq, dk, dv (3D)           dx D

Orion's programs are the same six with multi-output surfaces instead of one concat; what its
CPU moves to and from them is counted from its own step (bench/orion.py).
"""

from __future__ import annotations

import numpy as np

from ..ir.builder import GraphBuilder
from ..kernels.norms import plain_rms
from . import maderix

FORWARD = ("fwdAttn", "fwdFFN")
BACKWARD = ("ffnBwd", "sdpaBwd1", "sdpaBwd2", "qkvBwd")
KERNELS = FORWARD + BACKWARD
WEIGHTED = ("fwdAttn", "fwdFFN", "ffnBwd", "sdpaBwd1", "qkvBwd")


def _slice(b, x, start: int, channels: int, s: int, name: str):
    return b.slice_by_size(x, [0, start, 0, 0], [1, channels, 1, s], name=name)


def _conv(b, x, out_ch: int, in_ch: int, name: str):
    return b.conv(x, np.zeros((out_ch, in_ch), np.float32), name=name)


def build(kind: str, d: int, f: int, heads: int, s: int):
    """The graph of static kernel `kind` for an MHA model (Stories110M: D 768, H 2048, 12 heads)."""
    hd, sc = d // heads, heads * s
    b = GraphBuilder(kind)
    if kind == "fwdAttn":
        x = b.input("x", [1, d, 1, s])
        mask, _, _ = maderix._consts(b, s, hd)
        xn = plain_rms(b, x, np.ones(d, np.float32), name="rms1")
        q, k, v = (_conv(b, xn, d, d, n) for n in ("q", "k", "v"))
        qh, kh, vh = (maderix._heads(b, t, heads, hd, s, f"{n}h") for t, n in ((q, "q"), (k, "k"), (v, "v")))
        att = maderix._flat(b, b.matmul(maderix._scores(b, qh, kh, mask, hd, "p"), vh, name="pv"), heads, hd, s, "attn")
        outs = [_conv(b, att, d, d, "o"), q, k, v, att, xn]
    elif kind == "fwdFFN":
        x = b.input("x", [1, d, 1, s])
        xn = plain_rms(b, x, np.ones(d, np.float32), name="rms2")
        h1, h3 = _conv(b, xn, f, d, "h1"), _conv(b, xn, f, d, "h3")
        gate = b.mul(b.mul(h1, b.sigmoid(h1, name="sg"), name="silu"), h3, name="gate")
        outs = [_conv(b, gate, d, f, "ffn"), h1, h3, gate, xn]
    elif kind == "ffnBwd":
        x = b.input("x", [1, d + 2 * f, 1, s])
        dffn, h1, h3 = _slice(b, x, 0, d, s, "dffn"), _slice(b, x, d, f, s, "h1"), _slice(b, x, d + f, f, s, "h3")
        dsilu = _conv(b, dffn, f, d, "w2t")
        sg = b.sigmoid(h1, name="sg")
        silu = b.mul(h1, sg, name="silu")
        dh3 = b.mul(dsilu, silu, name="dh3")
        one_minus = b.sub(b.scalar(1.0), sg, name="om")
        grad = b.mul(sg, b.add(b.scalar(1.0), b.mul(h1, one_minus, name="hom"), name="g1"), name="dsg")
        dh1 = b.mul(b.mul(dsilu, h3, name="dh3g"), grad, name="dh1")
        dx = b.add(_conv(b, dh1, d, f, "w1t"), _conv(b, dh3, d, f, "w3t"), name="dx")
        outs = [dx, dh1, dh3]
    elif kind == "sdpaBwd1":
        x = b.input("x", [1, 4 * d, 1, s])
        mask, _, _ = maderix._consts(b, s, hd)
        q, k, v, dx2 = (_slice(b, x, i * d, d, s, f"in{i}") for i in range(4))
        da = _conv(b, dx2, d, d, "wot")
        qh, kh, vh, dah = (maderix._heads(b, t, heads, hd, s, f"h{i}") for i, t in enumerate((q, k, v, da)))
        p = maderix._scores(b, qh, kh, mask, hd, "p")
        dv = b.matmul(p, dah, transpose_x=True, name="dv")
        dp = b.matmul(dah, vh, transpose_y=True, name="dp")
        outs = [maderix._flat(b, dv, heads, hd, s, "dvo"), b.reshape(p, [1, sc, 1, s], name="po"),
                b.reshape(dp, [1, sc, 1, s], name="dpo")]
    elif kind == "sdpaBwd2":
        return maderix.build("sdpaBwd2", d, f, heads, heads, hd, s, 1)
    elif kind == "qkvBwd":
        x = b.input("x", [1, 3 * d, 1, s])
        parts = [_conv(b, _slice(b, x, i * d, d, s, f"in{i}"), d, d, n) for i, n in enumerate(("wqt", "wkt", "wvt"))]
        outs = [b.add(b.add(parts[0], parts[1], name="s01"), parts[2], name="dx")]
    else:
        raise ValueError(f"unknown static kernel {kind!r}; expected one of {', '.join(KERNELS)}")
    b.output("out", outs[0] if len(outs) == 1 else b.concat(outs, axis=1, name="cat"))
    return b.build()


def io_elements(kind: str, d: int, f: int, heads: int, s: int) -> tuple[int, int]:
    """(elements the host writes, elements it reads back) per evaluation. As for the dynamic
    pipeline (maderix.io_elements), sdpaBwd1's probs and dp are counted read there and written
    into sdpaBwd2."""
    sc = heads * s
    outs = {"fwdAttn": [d] * 6, "fwdFFN": [d, f, f, f, d], "ffnBwd": [d, f, f], "sdpaBwd1": [d, sc, sc],
            "sdpaBwd2": [d, d], "qkvBwd": [d]}[kind]
    ins = {"fwdAttn": d, "fwdFFN": d, "ffnBwd": d + 2 * f, "sdpaBwd1": 4 * d, "sdpaBwd2": 2 * sc + 2 * d,
           "qkvBwd": 3 * d}[kind]
    return ins * s, sum(outs) * s
