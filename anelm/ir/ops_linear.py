"""Linear ops: conv (1x1 is the ANE's linear layer), matmul, scaled_dot_product_attention."""

from __future__ import annotations

import math

import numpy as np

from .op_table import define
from .ops_common import FLOATS, as_list, bad, broadcast, dims, need_float, same_dtype, tensor

# ----------------------------------------------------------------------------- conv

PAD_TYPES = ("valid", "same", "same_lower", "custom")


def _conv_geometry(xs, ws, p):
    """Per spatial dim: (pad_before, pad_after, out_size), as MIL documents conv."""
    nsp = len(xs) - 2
    strides = as_list(p["strides"]) if p["strides"] is not None else [1] * nsp
    dil = as_list(p["dilations"]) if p["dilations"] is not None else [1] * nsp
    pad = as_list(p["pad"]) if p["pad"] is not None else [0] * (2 * nsp)
    if len(strides) != nsp or len(dil) != nsp or len(pad) != 2 * nsp:
        bad(f"strides/dilations of length {nsp} and pad of length {2 * nsp}",
            f"{strides}, {dil}, {pad}")
    if p["pad_type"] not in PAD_TYPES:
        bad(f"pad_type among {list(PAD_TYPES)}", repr(p["pad_type"]))
    geo = []
    for i in range(nsp):
        d, k, s, dl = xs[2 + i], ws[2 + i], int(strides[i]), int(dil[i])
        dk = (k - 1) * dl + 1
        if p["pad_type"] in ("same", "same_lower"):
            out = -(-d // s)
            total = max((out - 1) * s + dk - d, 0)
            lo = total // 2 if p["pad_type"] == "same" else total - total // 2
            hi = total - lo
        else:
            lo, hi = (int(pad[2 * i]), int(pad[2 * i + 1])) if p["pad_type"] == "custom" else (0, 0)
        out = (d + lo + hi - dk) // s + 1
        if out < 1:
            bad(f"a kernel (dilated {dk}) that fits spatial dim {i} of size {d + lo + hi}", k)
        geo.append((lo, hi, out, s, dl))
    return geo


def _infer_conv(t, p):
    x, w = t["x"], t["weight"]
    need_float(x)
    xs, ws = dims(x), dims(w)
    if len(xs) not in (3, 4) or len(ws) != len(xs):
        bad("x [N, C, (H,) W] and weight of the same rank (1-D or 2-D conv)", f"{list(xs)} and {list(ws)}")
    g = int(p["groups"])
    if g < 1 or xs[1] % g or ws[0] % g:
        bad(f"groups dividing C_in={xs[1]} and C_out={ws[0]}", g)
    if ws[1] * g != xs[1]:
        bad(f"weight shape[1] = C_in/groups = {xs[1] // g}", ws[1])
    if "bias" in t and dims(t["bias"]) != (ws[0],):
        bad(f"bias of shape [{ws[0]}]", list(dims(t["bias"])))
    geo = _conv_geometry(xs, ws, p)
    return [tensor(x.dtype, (xs[0], ws[0], *[g_[2] for g_ in geo]))]


def conv(x, p, conv2d=None):
    """conv's compute. `conv2d(v, w, bias, p)` does the 2-D arithmetic: by default float32 GEMMs
    plus the bias; the emulator passes its fixed-point accumulator (device/emulator_accum)."""
    v, w, bias = x["x"], x["weight"], x.get("bias")
    conv2d = conv2d or _conv2d_bias
    if v.ndim == 3:  # 1-D conv runs as 2-D with a unit height
        return [conv2d(v[:, :, None, :], w[:, :, None, :], bias, {**p, **_as_2d(p)})[:, :, 0, :]]
    return [conv2d(v, w, bias, p)]


def _conv2d_bias(v, w, bias, p):
    out = _conv2d(v, w, p)
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


def _as_2d(p):
    """1-D conv params with a leading unit height dimension."""
    def lift(v, fill):
        return None if v is None else fill + as_list(v)
    return {"strides": lift(p["strides"], [1]), "dilations": lift(p["dilations"], [1]),
            "pad": lift(p["pad"], [0, 0])}


def _conv2d(v, w, p):
    n, c, h, wd = v.shape
    oc, cg, kh, kw = w.shape
    g = int(p["groups"])
    if kh == kw == 1 and g == 1 and p["pad_type"] in ("valid", "same", "same_lower") \
            and all(int(s) == 1 for s in as_list(p["strides"] or [1])):
        # the ANE's linear layer: one float32 GEMM over channels, (OC, C) @ (N, C, H*W)
        return np.matmul(w.reshape(oc, c), v.reshape(n, c, h * wd)).reshape(n, oc, h, wd)
    (oh, ow), taps = conv_taps(v, w.shape, p)
    out = np.zeros((n, g, oc // g, oh * ow), np.float32)
    for w_tap, x_tap in taps:
        out += np.matmul(w_tap(w), x_tap)
    return out.reshape(n, oc, oh, ow)


def conv_taps(v, w_shape, p):
    """A 2-D conv as one product per kernel tap, in (row, column) order: ((OH, OW), [(w_tap, x_tap)])
    where `w_tap(w)` is the tap's weights (G, OC/G, C/G) and x_tap the input it multiplies
    (N, G, C/G, OH*OW); the conv is the sum over taps of w_tap(w) @ x_tap, grouped."""
    n, c = v.shape[:2]
    oc, cg, kh, kw = w_shape
    g = int(p["groups"])
    (lo_h, hi_h, oh, sh, dh), (lo_w, hi_w, ow, sw, dw) = _conv_geometry(v.shape, w_shape, p)
    vp = np.pad(v, ((0, 0), (0, 0), (lo_h, hi_h), (lo_w, hi_w)))
    vp = vp.reshape(n, g, c // g, vp.shape[2], vp.shape[3])  # (N, G, C/G, Hp, Wp)
    taps = []
    for i in range(kh):
        for j in range(kw):
            tap = vp[:, :, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            taps.append((lambda w, i=i, j=j: w.reshape(g, oc // g, cg, kh, kw)[:, :, :, i, j],  # (G, OC/G, C/G)
                         tap.reshape(n, g, c // g, oh * ow)))
    return (oh, ow), taps


define("conv", ("x", "weight", "bias"), _infer_conv, conv,
       params={"strides": None, "pad_type": "valid", "pad": None, "dilations": None, "groups": 1},
       optional=("bias",), const_inputs=("weight",))

# ----------------------------------------------------------------------------- matmul


def _mm_shapes(xs, ys, tx, ty):
    """(x, y) shapes after the transposes; rank-1 operands act as numpy's matmul says."""
    if not xs or not ys:
        bad("x and y of rank >= 1", f"{list(xs)} and {list(ys)}")
    if tx and len(xs) >= 2:
        xs = xs[:-2] + (xs[-1], xs[-2])
    if ty and len(ys) >= 2:
        ys = ys[:-2] + (ys[-1], ys[-2])
    return xs, ys


def _infer_matmul(t, p):
    dtype = same_dtype(t["x"], t["y"])
    if dtype not in FLOATS:
        bad("x and y of dtype fp16 or fp32", dtype)
    xs, ys = _mm_shapes(dims(t["x"]), dims(t["y"]), bool(p["transpose_x"]), bool(p["transpose_y"]))
    k_x = xs[-1]
    k_y = ys[-2] if len(ys) >= 2 else ys[0]
    if k_x != k_y:
        bad(f"x's last dim to match y's contracting dim (after transposes: x {list(xs)}, y {list(ys)})",
            f"{k_x} vs {k_y}")
    batch = broadcast(xs[:-2], ys[:-2], "batch dims")
    out = batch + (xs[-2:-1] if len(xs) >= 2 else ()) + (ys[-1:] if len(ys) >= 2 else ())
    return [tensor(dtype, out)]


def matmul(x, p, mm=np.matmul):
    """matmul's compute; `mm` multiplies (the emulator passes its accumulator's product)."""
    a, b = x["x"], x["y"]
    return [bind_matmul(p, (np.shape(a), np.shape(b)), mm)(a, b)]


def bind_matmul(p, shapes, mm=np.matmul):
    """matmul's compute for operands of `shapes`: the transposes are decided once."""
    flip_x = bool(p["transpose_x"]) and len(shapes[0]) >= 2
    flip_y = bool(p["transpose_y"]) and len(shapes[1]) >= 2
    if not (flip_x or flip_y):
        return mm
    return lambda a, b: mm(np.swapaxes(a, -1, -2) if flip_x else a, np.swapaxes(b, -1, -2) if flip_y else b)


define("matmul", ("x", "y"), _infer_matmul, matmul,
       params={"transpose_x": False, "transpose_y": False}, bind=bind_matmul)

# ----------------------------------------------------------------------------- attention


def _infer_sdpa(t, p):
    q, k, v = dims(t["query"]), dims(t["key"]), dims(t["value"])
    for name in ("query", "key", "value"):
        need_float(t[name], name)
    if not (len(q) == len(k) == len(v) >= 3):
        bad("query, key, value of one rank >= 3", f"{list(q)}, {list(k)}, {list(v)}")
    if not (q[:-2] == k[:-2] == v[:-2]):
        bad("query, key, value with the same batch dims", f"{list(q)}, {list(k)}, {list(v)}")
    if q[-1] != k[-1]:
        bad(f"key embedding E={q[-1]} (query's)", k[-1])
    if k[-2] != v[-2]:
        bad(f"value sequence S={k[-2]} (key's)", v[-2])
    if "attn_mask" in t:
        m = t["attn_mask"]
        if m.dtype not in ("bool", "fp16", "fp32"):
            bad("attn_mask of dtype bool, fp16 or fp32", m.dtype)
        broadcast(dims(m), q[:-1] + (k[-2],), "attn_mask and [B, *, L, S]")
    return [tensor(t["query"].dtype, q[:-1] + (v[-1],))]


def sdpa(x, p, mm=np.matmul):
    """scaled_dot_product_attention's compute; `mm` does its two products (q·kᵀ, then p·v)."""
    q, k, v = x["query"], x["key"], x["value"]
    scores = mm(q, np.swapaxes(k, -1, -2)) * np.float32(1.0 / math.sqrt(q.shape[-1]))
    mask = x.get("attn_mask")
    if mask is not None:
        # iOS18 semantics: a bool mask keeps positions where true; a float mask is added
        scores = np.where(mask, scores, np.float32(-np.inf)) if mask.dtype == np.bool_ else scores + mask
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return [np.asarray(mm(e / e.sum(axis=-1, keepdims=True), v), np.float32)]


define("scaled_dot_product_attention", ("query", "key", "value", "attn_mask"), _infer_sdpa, sdpa,
       optional=("attn_mask",))
