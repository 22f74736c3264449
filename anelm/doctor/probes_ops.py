"""Grade 1: one op per program, against a float64 numpy reference written here.

Every program has one fp16 input `x` and one output `y`, both in surfaces of at least
49,152 bytes, so binding order and surface rules cannot muddy an op's verdict. Constants are
named (`const()`), as our compiler writes them; the conv weight comes from a BLOBFILE.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..chip.profile import ChipProfile
from .harness import ELEMENTWISE, REDUCTION, Harness, Observation, Probe, blob, compare, data, f64
from .milgen import blob_const, const, literal, op, program, ttype

X = (1, 64, 1, 384)  # [B, C, 1, S]: 49,152 bytes in fp16, exactly the minimum surface
A = (1, 4, 64, 96)  # [B, H, L, D]: attention-shaped, also 49,152 bytes
CH = (np.arange(64, dtype=np.float64) % 9 + 4) / 8  # per-channel constant in [0.5, 1.5], exact in fp16
CH_CONST = const("c", "fp16", CH.reshape(1, 64, 1, 1))


def rejected_set(p: ChipProfile) -> set[str]:
    """Ops a device following `p` refuses to compile (the switches spelled out as op names)."""
    s = set(p.rejected_ops)
    if p.reject_reduce_mean:
        s.add("reduce_mean")
    if p.reject_rsqrt:
        s.add("rsqrt")
    return s


def expect_ops(ops: tuple[str, ...], then: str | Callable[[ChipProfile], str] = "ok"):
    """Predict `rejected` when any op is refused (or absent from the emulator's table), else `then`."""
    def expect(p: ChipProfile) -> str:
        from ..ir.ops import OP_TABLE  # noqa: PLC0415 - the emulator rejects ops it has no entry for

        if any(o in rejected_set(p) or o not in OP_TABLE for o in ops):
            return "rejected"
        return then if isinstance(then, str) else then(p)
    return expect


def single(name: str, opname: str, body: list[str], out_shape, ref, lo: float, hi: float,
           tol: float = ELEMENTWISE, in_shape=X, in_dtype: str = "fp16", out_dtype: str = "fp16",
           weights: Callable[[], dict] | None = None, ops: tuple[str, ...] | None = None,
           grade: int = 1, what: str = "") -> Probe:
    """A one-input one-output probe: `body` computes `y` from `x`; `ref(x64)` is the truth."""
    text = program([("x", in_dtype, in_shape)], body, ["y"])
    seed = sum(map(ord, name))

    def run(h: Harness) -> Observation:
        x = data(in_shape, lo, hi, seed, in_dtype)
        (got,) = h.run(text, [x], [(out_dtype, out_shape)], weights=weights() if weights else None)
        return compare(got, ref(f64(x)), tol)

    ops = ops or (opname,)
    return Probe(name, grade, what or f"{opname} against numpy", run, expect_ops(ops), ops)


def _binary(opname: str, fn, lo=-4.0, hi=4.0) -> Probe:
    body = [CH_CONST, op("y", "fp16", X, opname, x="x", y="c")]
    return single(f"op.{opname}", opname, body, X, lambda x: fn(x, CH.reshape(1, 64, 1, 1)), lo, hi,
                  what=f"{opname}(x, per-channel const) against numpy")


def _unary(opname: str, fn, lo: float, hi: float) -> Probe:
    return single(f"op.{opname}", opname, [op("y", "fp16", X, opname, x="x")], X, fn, lo, hi)


def _erf(v: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(v)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _reduce(opname: str, fn) -> Probe:
    body = [const("ax", "int32", [1]), const("kd", "bool", True),
            op("y", "fp16", (1, 1, 1, 384), opname, x="x", axes="ax", keep_dims="kd")]
    return single(f"op.{opname}", opname, body, (1, 1, 1, 384), lambda x: fn(x, axis=1, keepdims=True),
                  -4, 4, REDUCTION, what=f"{opname} over channels, keep_dims")


def _conv_weights() -> tuple[np.ndarray, Callable[[], dict]]:
    w = data((96, 64, 1, 1), -0.125, 0.125, 11)
    return w, lambda: {"@model_path/weights/w.bin": blob(w)[0]}


def _conv_probe() -> Probe:
    w, blobs = _conv_weights()
    body = [blob_const("W", "fp16", w.shape, "@model_path/weights/w.bin"),
            const("st", "int32", [1, 1]), const("pt", "string", "valid"), const("pd", "int32", [0, 0, 0, 0]),
            const("dl", "int32", [1, 1]), const("gr", "int32", 1),
            op("y", "fp16", (1, 96, 1, 384), "conv", x="x", weight="W", strides="st", pad_type="pt", pad="pd",
               dilations="dl", groups="gr")]
    ref = lambda x: np.einsum("oi,bis->bos", f64(w[:, :, 0, 0]), x[:, :, 0, :])[:, :, None, :]  # noqa: E731
    return single("op.conv", "conv", body, (1, 96, 1, 384), ref, -1, 1, REDUCTION, weights=blobs,
                  what="1x1 conv with a BLOBFILE weight (the linear layer)")


def _int8_conv_probe() -> Probe:
    q = np.random.default_rng(12).integers(-127, 128, size=(96, 64, 1, 1)).astype(np.int8)
    scale = 2.0 ** -10  # int8 weights × 1/1024: |w| < 0.125, exact in fp16
    path = "@model_path/weights/q.bin"
    # every operand of a constexpr_* op sits in the [...] brackets (maderix's W8A8 form)
    dequant = (f'{ttype("fp16", q.shape)} W = constexpr_affine_dequantize()[axis = int32(0), name = string("W"), '
               f'quantized_data = {ttype("int8", q.shape)}(BLOBFILE(path = string("{path}"), offset = uint64(64))), '
               f'scale = {literal("fp16", scale)}, zero_point = int8(0)];')
    body = [dequant, const("st", "int32", [1, 1]), const("pt", "string", "valid"), const("pd", "int32", [0, 0, 0, 0]),
            const("dl", "int32", [1, 1]), const("gr", "int32", 1),
            op("y", "fp16", (1, 96, 1, 384), "conv", x="x", weight="W", strides="st", pad_type="pt", pad="pd",
               dilations="dl", groups="gr")]
    ref = lambda x: np.einsum("oi,bis->bos", f64(q[:, :, 0, 0]) * scale, x[:, :, 0, :])[:, :, None, :]  # noqa: E731
    return single("op.constexpr_affine_dequantize", "constexpr_affine_dequantize", body, (1, 96, 1, 384), ref,
                  -1, 1, REDUCTION, weights=lambda: {path: blob(q)[0]}, ops=("constexpr_affine_dequantize", "conv"),
                  what="int8 BLOBFILE weights dequantized at compile time into a 1x1 conv")


def _layer_norm_probe() -> Probe:
    g, b = CH, CH - 1
    body = [const("ax", "int32", [1]), const("g", "fp16", g), const("bt", "fp16", b), const("eps", "fp16", 1e-5),
            op("y", "fp16", X, "layer_norm", x="x", axes="ax", gamma="g", beta="bt", epsilon="eps")]

    def ref(x):
        mu, var = x.mean(axis=1, keepdims=True), x.var(axis=1, keepdims=True)
        return (x - mu) / np.sqrt(var + float(np.float16(1e-5))) * g.reshape(1, 64, 1, 1) + b.reshape(1, 64, 1, 1)
    return single("op.layer_norm", "layer_norm", body, X, ref, -2, 2, REDUCTION,
                  what="layer_norm over channels with const gamma and beta")


def _cast_probe() -> Probe:
    shape = (1, 64, 1, 192)  # fp32: 49,152 bytes
    body = [const("to16", "string", "fp16"), const("to32", "string", "fp32"), CH_CONST,
            op("h", "fp16", shape, "cast", x="x", dtype="to16"), op("a", "fp16", shape, "add", x="h", y="c"),
            op("y", "fp32", shape, "cast", x="a", dtype="to32")]
    return single("op.cast", "cast", body, shape, lambda x: x + CH.reshape(1, 64, 1, 1), -4, 4,
                  in_shape=shape, in_dtype="fp32", out_dtype="fp32", ops=("cast", "add"),
                  what="fp32 surfaces, cast to fp16 on the input and back on the output")


def op_probes() -> list[Probe]:
    tF, tT = const("tF", "bool", False), const("tT", "bool", True)
    return [
        _binary("add", np.add), _binary("sub", np.subtract), _binary("mul", np.multiply),
        _binary("real_div", np.divide), _binary("maximum", np.maximum), _binary("minimum", np.minimum),
        single("op.pow", "pow", [const("e", "fp16", -0.5), op("y", "fp16", X, "pow", x="x", y="e")], X,
               lambda x: x ** -0.5, 0.25, 4, what="pow(x, -0.5): our rsqrt"),
        _unary("abs", np.abs, -4, 4), _unary("sqrt", np.sqrt, 0.05, 4), _unary("rsqrt", lambda x: 1 / np.sqrt(x), 0.25, 4),
        _unary("exp", np.exp, -4, 4), _unary("tanh", np.tanh, -3, 3),
        _unary("sigmoid", lambda x: 1 / (1 + np.exp(-x)), -6, 6), _unary("relu", lambda x: np.maximum(x, 0), -2, 2),
        _unary("silu", lambda x: x / (1 + np.exp(-x)), -4, 4),
        single("op.clip", "clip", [const("lo", "fp16", -1.0), const("hi", "fp16", 1.5),
                                   op("y", "fp16", X, "clip", x="x", alpha="lo", beta="hi")], X,
               lambda x: np.clip(x, -1, 1.5), -3, 3),
        single("op.softmax", "softmax", [const("ax", "int32", -1), op("y", "fp16", A, "softmax", x="x", axis="ax")],
               A, lambda x: _softmax(x, -1), -4, 4, REDUCTION, in_shape=A, what="softmax over the last axis"),
        _reduce("reduce_sum", np.sum), _reduce("reduce_mean", np.mean), _reduce("reduce_max", np.max),
        single("op.reshape", "reshape", [const("sh", "int32", [1, 128, 1, 192]),
                                         op("y", "fp16", (1, 128, 1, 192), "reshape", x="x", shape="sh")],
               (1, 128, 1, 192), lambda x: x.reshape(1, 128, 1, 192), -4, 4),
        single("op.transpose", "transpose", [const("pm", "int32", [0, 1, 3, 2]),
                                             op("y", "fp16", (1, 4, 96, 64), "transpose", x="x", perm="pm")],
               (1, 4, 96, 64), lambda x: x.transpose(0, 1, 3, 2), -4, 4, in_shape=A),
        single("op.slice_by_size", "slice_by_size",
               [const("b", "int32", [0, 0, 0, 64]), const("sz", "int32", [1, 64, 1, 128]),
                op("y", "fp16", (1, 64, 1, 128), "slice_by_size", x="x", begin="b", size="sz")],
               (1, 64, 1, 128), lambda x: x[:, :, :, 64:192], -4, 4, what="slice with a nonzero last-axis offset"),
        single("op.slice_by_index", "slice_by_index",
               [const("b", "int32", [0, 8, 0, 32]), const("e", "int32", [1, 40, 1, 288]),
                op("y", "fp16", (1, 32, 1, 256), "slice_by_index", x="x", begin="b", end="e")],
               (1, 32, 1, 256), lambda x: x[:, 8:40, :, 32:288], -4, 4),
        single("op.matmul", "matmul", [tF, tT, op("y", "fp16", (1, 4, 64, 64), "matmul", x="x", y="x",
                                                  transpose_x="tF", transpose_y="tT")],
               (1, 4, 64, 64), lambda x: x @ x.transpose(0, 1, 3, 2), -1, 1, REDUCTION, in_shape=A,
               what="x @ x^T with named transpose consts"),
        _layer_norm_probe(), _conv_probe(), _int8_conv_probe(), _cast_probe(),
        single("op.concat", "concat", [const("two", "fp16", 2.0), const("ax", "int32", 1), const("il", "bool", False),
                                       op("x2", "fp16", X, "mul", x="x", y="two"),
                                       op("y", "fp16", (1, 128, 1, 384), "concat", values="(x, x2)", axis="ax",
                                          interleave="il")],
               (1, 128, 1, 384), lambda x: np.concatenate([x, 2 * x], axis=1), -4, 4, ops=("concat", "mul")),
        single("op.gelu", "gelu", [const("md", "string", "EXACT"), op("y", "fp16", X, "gelu", x="x", mode="md")], X,
               lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), -4, 4, what="gelu (exact erf form)"),
    ]
