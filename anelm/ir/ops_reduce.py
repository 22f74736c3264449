"""Reductions and the ops built on them: reduce_sum/mean/max, softmax, layer_norm."""

from __future__ import annotations

import numpy as np

from .op_table import define
from .ops_common import axes_of, axis_of, bad, dims, need_float, tensor

# ----------------------------------------------------------------------------- reduce_*


def _infer_reduce(t, p):
    x = t["x"]
    shape = dims(x)
    axes = axes_of(p["axes"], len(shape))
    if p["keep_dims"]:
        out = tuple(1 if i in axes else d for i, d in enumerate(shape))
    else:
        out = tuple(d for i, d in enumerate(shape) if i not in axes)
    return [tensor(x.dtype, out)]


def _reducer(fn):
    def bind(p, shapes):
        axes, keep = tuple(axes_of(p["axes"], len(shapes[0]))), bool(p["keep_dims"])
        return lambda v: np.asarray(fn(v, axis=axes, keepdims=keep), dtype=np.float32)

    def compute(x, p):
        return [bind(p, (np.shape(x["x"]),))(x["x"])]
    return compute, bind


# the ufuncs' reduce is what np.sum and np.max call on an ndarray, without their dispatch
for _name, _fn in (("reduce_sum", np.add.reduce), ("reduce_mean", np.mean), ("reduce_max", np.maximum.reduce)):
    _compute, _bind = _reducer(_fn)
    define(_name, ("x",), _infer_reduce, _compute, params={"axes": None, "keep_dims": False}, bind=_bind)

# ----------------------------------------------------------------------------- softmax


def _infer_softmax(t, p):
    need_float(t["x"])
    axis_of(int(p["axis"]), len(dims(t["x"])))
    return [t["x"]]


def _softmax(x, p):
    v = x["x"]
    ax = int(p["axis"])
    # shifting by the max keeps exp finite; the row sum is then >= 1. One buffer, in place.
    e = np.subtract(v, v.max(axis=ax, keepdims=True))
    np.exp(e, out=e)
    e /= e.sum(axis=ax, keepdims=True)
    return [e]


define("softmax", ("x",), _infer_softmax, _softmax, params={"axis": -1})

# ----------------------------------------------------------------------------- layer_norm


def _infer_layer_norm(t, p):
    x = t["x"]
    need_float(x)
    shape = dims(x)
    axes = axes_of(p["axes"], len(shape))
    want = tuple(shape[a] for a in axes)
    for name in ("gamma", "beta"):
        if name in t and dims(t[name]) != want:
            bad(f"{name} of shape x.shape[axes] = {list(want)}", list(dims(t[name])))
    return [x]


def _layer_norm(x, p):
    v = x["x"]
    axes = tuple(axes_of(p["axes"], v.ndim))
    mean = v.mean(axis=axes, keepdims=True)
    var = np.square(v - mean).mean(axis=axes, keepdims=True)
    out = (v - mean) / np.sqrt(var + np.float32(p["epsilon"]))
    # gamma/beta have shape x.shape[axes]; place them on those axes to broadcast
    bshape = [v.shape[i] if i in axes else 1 for i in range(v.ndim)]
    if x.get("gamma") is not None:
        out = out * x["gamma"].reshape(bshape)
    if x.get("beta") is not None:
        out = out + x["beta"].reshape(bshape)
    return [out.astype(np.float32)]


define("layer_norm", ("x", "gamma", "beta"), _infer_layer_norm, _layer_norm,
       params={"axes": None, "epsilon": 1e-5}, optional=("gamma", "beta"))
