"""A tiny float64 numpy interpreter for `Graph`s, written for the tests.

It is independent of OP_TABLE.compute on purpose: pass tests run a graph through it before and
after a pass and check the numbers agree. Imported by basename (pytest puts this folder on
sys.path).
"""

from __future__ import annotations

import math

import numpy as np


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def _gelu(v, mode):
    if mode == "EXACT":
        return 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0)))
    if mode == "SIGMOID_APPROXIMATION":
        return v * _sig(1.702 * v)
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def _axes(p, v):
    ax = p.get("axes")
    return tuple(range(v.ndim)) if ax is None else tuple(int(a) % v.ndim for a in ax)


def _reduce(fn):
    return lambda a, p: fn(a["x"], axis=_axes(p, a["x"]), keepdims=bool(p.get("keep_dims", False)))


def _softmax(a, p):
    v, ax = a["x"], int(p.get("axis", -1))
    e = np.exp(v - v.max(axis=ax, keepdims=True))
    return e / e.sum(axis=ax, keepdims=True)


def _matmul(a, p):
    x, y = a["x"], a["y"]
    if p.get("transpose_x"):
        x = np.swapaxes(x, -1, -2)
    if p.get("transpose_y"):
        y = np.swapaxes(y, -1, -2)
    return x @ y


def _conv(a, p):  # 1x1, stride 1, groups 1: the ANE linear layer
    w = a["weight"]
    assert w.shape[2:] == (1, 1) and int(p.get("groups", 1)) == 1, "test interpreter: 1x1 conv only"
    y = np.einsum("oi,bihw->bohw", w[:, :, 0, 0], a["x"])
    if a.get("bias") is not None:
        y = y + a["bias"].reshape(1, -1, 1, 1)
    return y


def _layer_norm(a, p):
    v = a["x"]
    ax = _axes(p, v)
    mu = v.mean(axis=ax, keepdims=True)
    out = (v - mu) / np.sqrt(((v - mu) ** 2).mean(axis=ax, keepdims=True) + p.get("epsilon", 1e-5))
    shape = [v.shape[i] if i in ax else 1 for i in range(v.ndim)]
    if a.get("gamma") is not None:
        out = out * a["gamma"].reshape(shape)
    if a.get("beta") is not None:
        out = out + a["beta"].reshape(shape)
    return out


def _sdpa(a, p):
    q, k, v = a["query"], a["key"], a["value"]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    m = a.get("attn_mask")
    if m is not None:
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m
    return _softmax({"x": s}, {"axis": -1}) @ v


def _slice_by_size(a, p):
    v = a["x"]
    key = tuple(slice(b, d if s == -1 else b + s) for b, s, d in zip(p["begin"], p["size"], v.shape))
    return v[key]


def _slice_by_index(a, p):
    v = a["x"]
    stride = p.get("stride") or [1] * v.ndim
    return v[tuple(slice(b, e, s) for b, e, s in zip(p["begin"], p["end"], stride))]


def _cast(a, p):
    dt = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "int8": np.int8, "bool": bool}[p["dtype"]]
    return a["x"].astype(dt).astype(np.float64)


OPS = {
    "identity": lambda a, p: a["x"],
    "add": lambda a, p: a["x"] + a["y"],
    "sub": lambda a, p: a["x"] - a["y"],
    "mul": lambda a, p: a["x"] * a["y"],
    "real_div": lambda a, p: a["x"] / a["y"],
    "pow": lambda a, p: np.power(a["x"], a["y"]),
    "maximum": lambda a, p: np.maximum(a["x"], a["y"]),
    "minimum": lambda a, p: np.minimum(a["x"], a["y"]),
    "sqrt": lambda a, p: np.sqrt(a["x"]),
    "rsqrt": lambda a, p: 1.0 / np.sqrt(a["x"] + p.get("epsilon", 1e-12)),
    "exp": lambda a, p: np.exp(a["x"]),
    "tanh": lambda a, p: np.tanh(a["x"]),
    "sigmoid": lambda a, p: _sig(a["x"]),
    "silu": lambda a, p: a["x"] * _sig(a["x"]),
    "relu": lambda a, p: np.maximum(a["x"], 0.0),
    "gelu": lambda a, p: _gelu(a["x"], p.get("mode", "EXACT")),
    "clip": lambda a, p: np.clip(a["x"], p["alpha"], p["beta"]),
    "softmax": _softmax,
    "reduce_sum": _reduce(np.sum),
    "reduce_mean": _reduce(np.mean),
    "reduce_max": _reduce(np.max),
    "reshape": lambda a, p: a["x"].reshape(p["shape"]),
    "transpose": lambda a, p: np.transpose(a["x"], p["perm"]),
    "slice_by_size": _slice_by_size,
    "slice_by_index": _slice_by_index,
    "concat": lambda a, p: np.concatenate(a["values"], axis=int(p["axis"])),
    "cast": _cast,
    "matmul": _matmul,
    "conv": _conv,
    "layer_norm": _layer_norm,
    "scaled_dot_product_attention": _sdpa,
}


def _as64(v):
    v = np.asarray(v)
    return v if v.dtype == bool else v.astype(np.float64)


def evaluate(graph, inputs) -> dict[str, np.ndarray]:
    """Outputs by (user-facing) output name; `inputs` in declared order (names may be rewritten)."""
    env = {id(v): _as64(a) for v, a in zip(graph.inputs, inputs)}
    for n in graph.nodes:
        if n.op == "const":
            env[id(n.out)] = _as64(n.value)
            continue
        args = {k: [env[id(i)] for i in v] if isinstance(v, tuple) else env[id(v)] for k, v in n.inputs.items()}
        env[id(n.out)] = np.asarray(OPS[n.op](args, n.params), dtype=np.float64)
    return {k: env[id(v)] for k, v in graph.outputs.items()}

