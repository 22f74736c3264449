"""Grade 4: transformer kernels in the conservative forms our compiler emits (docs/chip-profiles.md).

RMSNorm as reduce_sum × 1/C and pow(x, -0.5); causal attention decomposed into matmul,
scale, additive mask and softmax (SDPA's mask is not trusted); SwiGLU as three 1×1 convs with
silu written x·sigmoid(x). Tolerance: a transformer block's 2e-2 (docs/testing.md).
"""

from __future__ import annotations

import numpy as np

from .harness import BLOCK, Harness, Observation, Probe, blob, compare, data, f64
from .milgen import blob_const, const, op, program
from .probes_ops import CH, A, X, expect_ops, single
from .probes_semantics import CONV_ARGS, CONV_CONSTS, causal_mask, softmax

EPS = float(np.float16(1e-5))


def _rmsnorm() -> Probe:
    w = CH.reshape(1, 64, 1, 1).astype(np.float16)
    r1 = (1, 1, 1, 384)
    body = [const("ax", "int32", [1]), const("kd", "bool", True), const("inv", "fp16", 1 / 64),
            const("eps", "fp16", EPS), const("e", "fp16", -0.5), blob_const("w", "fp16", w.shape, "@model_path/weights/w.bin"),
            op("sq", "fp16", X, "mul", x="x", y="x"), op("ss", "fp16", r1, "reduce_sum", x="sq", axes="ax", keep_dims="kd"),
            op("ms", "fp16", r1, "mul", x="ss", y="inv"), op("me", "fp16", r1, "add", x="ms", y="eps"),
            op("r", "fp16", r1, "pow", x="me", y="e"), op("n", "fp16", X, "mul", x="x", y="r"),
            op("y", "fp16", X, "mul", x="n", y="w")]
    ref = lambda x: x / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS) * f64(w)  # noqa: E731
    return single("kernel.rmsnorm", "reduce_sum", body, X, ref, -2, 2, BLOCK, grade=4,
                  weights=lambda: {"@model_path/weights/w.bin": blob(w)[0]}, ops=("mul", "reduce_sum", "add", "pow"),
                  what="RMSNorm: reduce_sum x 1/C, pow(-0.5), weight from a blob")


def _attention(h: Harness) -> Observation:
    hd, out = 32, (1, 4, 64, 32)
    scale = float(np.float16(1 / np.sqrt(hd)))
    body = [const("b0", "int32", [0, 0, 0, 0]), const("b1", "int32", [0, 0, 0, hd]), const("b2", "int32", [0, 0, 0, 2 * hd]),
            const("sz", "int32", [1, 4, 64, hd]), const("tF", "bool", False), const("tT", "bool", True),
            const("sc", "fp16", scale), const("ax", "int32", -1),
            blob_const("m", "fp16", (1, 1, 64, 64), "@model_path/weights/mask.bin")]
    body += [op(n, "fp16", out, "slice_by_size", x="x", begin=b, size="sz") for n, b in (("q", "b0"), ("k", "b1"), ("v", "b2"))]
    body += [op("s", "fp16", (1, 4, 64, 64), "matmul", x="q", y="k", transpose_x="tF", transpose_y="tT"),
             op("s2", "fp16", (1, 4, 64, 64), "mul", x="s", y="sc"), op("s3", "fp16", (1, 4, 64, 64), "add", x="s2", y="m"),
             op("p", "fp16", (1, 4, 64, 64), "softmax", x="s3", axis="ax"),
             op("y", "fp16", out, "matmul", x="p", y="v", transpose_x="tF", transpose_y="tF")]
    x = data(A, -1, 1, 121)
    (got,) = h.run(program([("x", "fp16", A)], body, ["y"]), [x], [("fp16", out)],
                   weights={"@model_path/weights/mask.bin": blob(causal_mask(64))[0]})
    q, k, v = (f64(x)[..., i * hd:(i + 1) * hd] for i in range(3))
    ref = softmax(q @ k.transpose(0, 1, 3, 2) * scale + f64(causal_mask(64))) @ v
    return compare(got, ref, BLOCK)


def _swiglu() -> Probe:
    w1, w3 = data((128, 64, 1, 1), -0.125, 0.125, 131), data((128, 64, 1, 1), -0.125, 0.125, 132)
    w2 = data((64, 128, 1, 1), -0.09, 0.09, 133)
    hid = (1, 128, 1, 384)
    body = [*CONV_CONSTS] + [blob_const(n, "fp16", w.shape, f"@model_path/weights/{n}.bin")
                             for n, w in (("W1", w1), ("W3", w3), ("W2", w2))]
    body += [op("h1", "fp16", hid, "conv", x="x", weight="W1", **CONV_ARGS),
             op("h3", "fp16", hid, "conv", x="x", weight="W3", **CONV_ARGS),
             op("sg", "fp16", hid, "sigmoid", x="h1"), op("g", "fp16", hid, "mul", x="h1", y="sg"),
             op("m", "fp16", hid, "mul", x="g", y="h3"), op("y", "fp16", X, "conv", x="m", weight="W2", **CONV_ARGS)]

    def ref(x):
        lin = lambda w, t: np.einsum("oi,bis->bos", f64(w[:, :, 0, 0]), t[:, :, 0, :])[:, :, None, :]  # noqa: E731
        h1, h3 = lin(w1, x), lin(w3, x)
        return lin(w2, h1 / (1 + np.exp(-h1)) * h3)

    weights = lambda: {f"@model_path/weights/{n}.bin": blob(w)[0] for n, w in (("W1", w1), ("W3", w3), ("W2", w2))}  # noqa: E731
    return single("kernel.swiglu", "conv", body, X, ref, -1, 1, BLOCK, grade=4, weights=weights,
                  ops=("conv", "sigmoid", "mul"), what="SwiGLU FFN: three 1x1 convs, silu as x*sigmoid(x)")


def _sqrt_after_reduce() -> Probe:
    r1 = (1, 1, 1, 384)
    body = [const("ax", "int32", [1]), const("kd", "bool", True), op("sq", "fp16", X, "mul", x="x", y="x"),
            op("ss", "fp16", r1, "reduce_sum", x="sq", axes="ax", keep_dims="kd"), op("y", "fp16", r1, "sqrt", x="ss")]
    p = single("kernel.sqrt_after_reduce", "sqrt", body, r1, lambda x: np.sqrt((x * x).sum(axis=1, keepdims=True)),
               -2, 2, BLOCK, grade=4, ops=("mul", "reduce_sum", "sqrt"),
               what="sqrt right after a reduce (rustane: fails there)")
    return Probe(p.name, p.grade, p.what, p.run,
                 expect_ops(p.ops, lambda q: "rejected" if q.reject_rsqrt else "ok"), p.ops)


def kernel_probes() -> list[Probe]:
    ops = ("slice_by_size", "matmul", "mul", "add", "softmax")
    return [_rmsnorm(),
            Probe("kernel.attention", 4, "causal attention, decomposed, mask from a blob", _attention, expect_ops(ops), ops),
            _swiglu(), _sqrt_after_reduce()]

