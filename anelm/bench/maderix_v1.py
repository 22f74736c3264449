"""maderix's first dynamic pipeline, the program its published step breakdown was timed on
(maderix/ANE training/training_dynamic/train.m at 60b0512: 110 ms/step and the breakdown ane_fwd
21, ane_bwd 28, io_fwd 12, io_bwd 15, silu 10, cls 13, rms 5 ms, from that version's commit message).

It differs from the pipeline at HEAD (bench/maderix.py) where the breakdown's parts feel it:
nine kernels (Wo inside sdpaFwd, the FFN forward split in two, one qkvBwd, no RoPE), fp32
surfaces for the seven weight-bearing kernels (cast to fp16 inside), and every weight copied
from the CPU's fp32 arrays into its kernel's input before every evaluation (write_sdpa_fwd_input,
io_write_dyn: row memcpys), not once per update. Outputs are read back as fp32 memcpys; only
sdpaBwd1 and sdpaBwd2 run on fp16 surfaces, written through NEON conversion.

    kernel       surface  input channels x columns      outputs
    sdpaFwd      fp32     D x (S + 4D)                  o, Q, K, V, attn, xnorm (6D)
    ffnW13       fp32     D x (S + 2H)                  h1, h3, gate (3H)
    ffnW2        fp32     H x (S + D)                   ffn (D)
    ffnBwdW2t    fp32     D x (S + H)                   dgate (H)
    ffnBwdW13t   fp32     H x (2S + 2D)                 dx (D)
    wotBwd       fp32     D x (S + D)                   da (D)
    sdpaBwd1     fp16     4D x S                        dV, probs, dp
    sdpaBwd2     fp16     (2·heads·S + 2D) x S          dQ, dK
    qkvBwd       fp32     D x (3S + 3D)                 dx (D)
"""

from __future__ import annotations

from ..ir.builder import GraphBuilder
from . import maderix

FORWARD = ("sdpaFwd", "ffnW13", "ffnW2")
BACKWARD = ("ffnBwdW2t", "ffnBwdW13t", "wotBwd", "sdpaBwd1", "sdpaBwd2", "qkvBwd")
KERNELS = FORWARD + BACKWARD
SAME_AS_HEAD = ("ffnBwdW2t", "ffnBwdW13t", "wotBwd", "sdpaBwd1", "sdpaBwd2")
FP16_SURFACES = ("sdpaBwd1", "sdpaBwd2")


def build(kind: str, d: int, f: int, heads: int, s: int):
    """The graph of first-version kernel `kind` for an MHA model (Stories110M: D 768, H 2048)."""
    hd = d // heads
    if kind in SAME_AS_HEAD:
        return maderix.build(kind, d, f, heads, heads, hd, s, 1, "fp16" if kind in FP16_SURFACES else "fp32")
    b = GraphBuilder(kind)
    mm = maderix._dyn_matmul
    if kind == "sdpaFwd":
        x = maderix.packed_input(b, [1, d, 1, s + 4 * d], "fp32")
        mask, _, _ = maderix._consts(b, s, hd)
        q, k, v = (mm(b, x, d, s, 0, s + i * d, d, n) for i, n in enumerate("qkv"))
        qh, kh, vh = (maderix._heads(b, t, heads, hd, s, f"{n}h") for t, n in ((q, "q"), (k, "k"), (v, "v")))
        att = maderix._flat(b, b.matmul(maderix._scores(b, qh, kh, mask, hd, "p"), vh, name="pv"), heads, hd, s, "attn")
        o = maderix.times_packed_weight(b, att, x, d, s, s + 3 * d, d, "o")
        xn = b.slice_by_size(x, [0, 0, 0, 0], [1, d, 1, s], name="xn")
        outs = [o, q, k, v, att, xn]
    elif kind == "ffnW13":
        x = maderix.packed_input(b, [1, d, 1, s + 2 * f], "fp32")
        h1, h3 = mm(b, x, d, s, 0, s, f, "h1"), mm(b, x, d, s, 0, s + f, f, "h3")
        outs = [h1, h3, b.mul(b.mul(h1, b.sigmoid(h1, name="sg"), name="silu"), h3, name="gate")]
    elif kind == "ffnW2":
        x = maderix.packed_input(b, [1, f, 1, s + d], "fp32")
        outs = [mm(b, x, f, s, 0, s, d, "ffn")]
    elif kind == "qkvBwd":
        x = maderix.packed_input(b, [1, d, 1, 3 * s + 3 * d], "fp32")
        dq, dk, dv = (mm(b, x, d, s, i * s, 3 * s + i * d, d, n) for i, n in enumerate(("dq", "dk", "dv")))
        outs = [b.add(b.add(dq, dk, name="s01"), dv, name="dx")]
    else:
        raise ValueError(f"unknown first-version kernel {kind!r}; expected one of {', '.join(KERNELS)}")
    return maderix.packed_output(b, outs, "fp32")


def host_traffic(kind: str, d: int, f: int, heads: int, s: int) -> dict[str, int]:
    """Elements the CPU moves for one evaluation of `kind`, by how: "copy32" activations
    memcpy'd to and from fp32 surfaces, "weights32" the kernel's weights memcpy'd into its input
    (every evaluation), "convert" fp32<->fp16 through NEON, "copy16" fp16 surface to surface.
    What train.m reads back: sdpaFwd's first five outputs, ffnW13's three plus a copy of gate."""
    sc = heads * s
    table = {
        "sdpaFwd": {"copy32": d * s + 5 * d * s, "weights32": 4 * d * d},
        "ffnW13": {"copy32": d * s + 4 * f * s, "weights32": 2 * d * f},
        "ffnW2": {"copy32": f * s + d * s, "weights32": f * d},
        "ffnBwdW2t": {"copy32": d * s + f * s, "weights32": d * f},
        "ffnBwdW13t": {"copy32": 2 * f * s + d * s, "weights32": 2 * f * d},
        "wotBwd": {"copy32": 2 * d * s, "weights32": d * d},
        "sdpaBwd1": {"convert": 4 * d * s + d * s},                # Q, K, V, da in; dV out
        "sdpaBwd2": {"copy16": 2 * sc * s, "convert": 4 * d * s},  # probs, dp copied; Q, K in; dQ, dK out
        "qkvBwd": {"copy32": 3 * d * s + d * s, "weights32": 3 * d * d},
    }
    return table[kind]
