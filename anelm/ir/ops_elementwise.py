"""Elementwise ops: const, binary arithmetic with MIL broadcasting, activations, clip, cast."""

from __future__ import annotations

import math

import numpy as np

from ..mil.program import NUMPY_DTYPES, TensorType
from .op_table import REQUIRED, define
from .ops_common import bad, broadcast, dims, need_float, same_dtype, tensor

# ----------------------------------------------------------------------------- const


def _infer_const(t, p):
    return [t["val"]]


def _const(x, p):
    return [x["val"]]


# `val` sits in the attribute brackets: `const()[name = ..., val = tensor<...>(...)]`.
define("const", ("val",), _infer_const, _const, in_attrs=True)

# ----------------------------------------------------------------------------- binary


def _infer_binary(t, p):
    dtype = same_dtype(t["x"], t["y"])
    shape = broadcast(dims(t["x"]), dims(t["y"]))
    # two scalars give a scalar, as MIL types it
    if t["x"].shape is None and t["y"].shape is None:
        return [TensorType(dtype, None)]
    return [tensor(dtype, shape)]


def _binary(fn):
    def compute(x, p):
        return [fn(x["x"], x["y"])]
    return compute


def _real_div(a, b):
    return np.divide(a, b, dtype=np.float32)


def _pow(a, b):
    # fp16 hardware gives inf/nan rather than raising; numpy warnings are silenced by the caller
    return np.power(a, b, dtype=np.float32)


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": _real_div,
    "pow": _pow, "maximum": np.maximum, "minimum": np.minimum,
}
for _name, _fn in _BINARY.items():
    define(_name, ("x", "y"), _infer_binary, _binary(_fn), bind=lambda p, shapes, fn=_fn: fn)

# ----------------------------------------------------------------------------- unary


def _infer_unary(t, p):
    need_float(t["x"])
    return [t["x"]]


def _sigmoid(v):
    # exp(-v) may overflow to inf for very negative v; 1 / (1 + inf) is then the right 0
    e = np.negative(v)
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    e += np.float32(1)
    return np.reciprocal(e, out=e)


def _erf(v):
    # Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, far below fp16 resolution; numpy has no erf
    a = np.abs(v).astype(np.float64)
    k = 1.0 / (1.0 + 0.3275911 * a)
    poly = k * (0.254829592 + k * (-0.284496736 + k * (1.421413741 + k * (-1.453152027 + k * 1.061405429))))
    return (np.sign(v) * (1.0 - poly * np.exp(-a * a))).astype(np.float32)


def _gelu(v, mode):
    if mode == "EXACT":
        return (0.5 * v * (1.0 + _erf(v / np.float32(math.sqrt(2.0))))).astype(np.float32)
    if mode == "TANH_APPROXIMATION":
        inner = math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v)
        return (0.5 * v * (1.0 + np.tanh(inner))).astype(np.float32)
    if mode == "SIGMOID_APPROXIMATION":
        return (v * _sigmoid(1.702 * v)).astype(np.float32)
    bad("gelu mode EXACT, TANH_APPROXIMATION or SIGMOID_APPROXIMATION", mode)


def _infer_gelu(t, p):
    if p["mode"] not in ("EXACT", "TANH_APPROXIMATION", "SIGMOID_APPROXIMATION"):
        bad("mode EXACT, TANH_APPROXIMATION or SIGMOID_APPROXIMATION", p["mode"])
    return _infer_unary(t, p)


def _unary(fn):
    def compute(x, p):
        return [fn(x["x"])]
    return compute


_UNARY = {
    "abs": np.abs,
    "sqrt": np.sqrt,
    "exp": np.exp,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "silu": lambda v: (v * _sigmoid(v)).astype(np.float32),
    "relu": lambda v: np.maximum(v, np.float32(0)),
}
for _name, _fn in _UNARY.items():
    define(_name, ("x",), _infer_unary, _unary(_fn), bind=lambda p, shapes, fn=_fn: fn)

define("rsqrt", ("x",), _infer_unary,
       lambda x, p: [(1.0 / np.sqrt(x["x"] + np.float32(p["epsilon"]))).astype(np.float32)],
       params={"epsilon": 1e-12})
define("gelu", ("x",), _infer_gelu, lambda x, p: [_gelu(x["x"], p["mode"])],
       params={"mode": "EXACT"})

# ----------------------------------------------------------------------------- clip, cast


def _infer_clip(t, p):
    need_float(t["x"])
    if float(p["alpha"]) > float(p["beta"]):
        bad("alpha <= beta", f"alpha={p['alpha']}, beta={p['beta']}")
    return [t["x"]]


define("clip", ("x",), _infer_clip,
       lambda x, p: [np.clip(x["x"], np.float32(p["alpha"]), np.float32(p["beta"]))],
       params={"alpha": REQUIRED, "beta": REQUIRED})

CAST_DTYPES = ("fp16", "fp32", "int8", "uint8", "int16", "uint16", "int32", "bool")


def _infer_cast(t, p):
    if p["dtype"] not in CAST_DTYPES:
        bad(f"dtype among {list(CAST_DTYPES)}", repr(p["dtype"]))
    return [TensorType(p["dtype"], t["x"].shape)]


def _cast(x, p):
    dt = p["dtype"]
    # floats stay float32 arrays in the emulator; the result rounding applies the declared dtype
    target = np.float32 if dt in ("fp16", "fp32") else NUMPY_DTYPES[dt]
    return [np.asarray(x["x"]).astype(target)]


define("cast", ("x",), _infer_cast, _cast, params={"dtype": REQUIRED})
