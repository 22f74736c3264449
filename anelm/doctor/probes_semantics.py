"""Grade 3: what the compiler refuses and what the chip computes: the strict profile's compile-time
rejects, SDPA ignoring its mask, weights read at compile and fp16 computation
(docs/chip-profiles.md).

The references disagree here (SDPA masks, reloading rewritten weights, multi-chunk blobs,
saturation), so each probe reads the behaviour off the numbers rather than assuming it.
"""

from __future__ import annotations

import numpy as np

from .harness import BLOCK, ELEMENTWISE, REDUCTION, Harness, Observation, Probe, blob, compare, data, f64, rel_err
from .milgen import blob_const, const, op, program
from .probes_ops import A, CH, X, expect_ops, single

FP16_MIN = -65504.0  # the causal mask's "minus infinity", as maderix writes mask.bin
CONV_CONSTS = [const("st", "int32", [1, 1]), const("pt", "string", "valid"), const("pd", "int32", [0, 0, 0, 0]),
               const("dl", "int32", [1, 1]), const("gr", "int32", 1)]
CONV_ARGS = dict(strides="st", pad_type="pt", pad="pd", dilations="dl", groups="gr")


def causal_mask(n: int) -> np.ndarray:
    """[1, 1, n, n]: 0 where key <= query, -65504 above the diagonal (row = query)."""
    return np.triu(np.full((n, n), FP16_MIN), k=1).astype(np.float16)[None, None]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- compile rejects


def _conv_bias() -> Probe:
    w, b = data((96, 64, 1, 1), -0.125, 0.125, 51), data((96,), -1, 1, 52)
    body = [blob_const("W", "fp16", w.shape, "@model_path/weights/w.bin"), const("b", "fp16", b), *CONV_CONSTS,
            op("y", "fp16", (1, 96, 1, 384), "conv", x="x", weight="W", bias="b", **CONV_ARGS)]
    ref = lambda x: np.einsum("oi,bis->bos", f64(w[:, :, 0, 0]), x[:, :, 0, :])[:, :, None, :] \
        + f64(b).reshape(1, 96, 1, 1)  # noqa: E731
    p = single("compile.conv_bias", "conv", body, (1, 96, 1, 384), ref, -1, 1, REDUCTION, grade=3,
               weights=lambda: {"@model_path/weights/w.bin": blob(w)[0]}, what="conv with a bias= argument")
    return _with_expect(p, lambda q: "rejected" if q.reject_conv_bias else "ok")


def _conv_dynamic_weight() -> Probe:
    body = [const("b0", "int32", [0, 0, 0, 0]), const("sz", "int32", [1, 64, 1, 64]),
            const("sh", "int32", [64, 64, 1, 1]), *CONV_CONSTS,
            op("ws", "fp16", (1, 64, 1, 64), "slice_by_size", x="x", begin="b0", size="sz"),
            op("w", "fp16", (64, 64, 1, 1), "reshape", x="ws", shape="sh"),
            op("y", "fp16", X, "conv", x="x", weight="w", **CONV_ARGS)]
    ref = lambda x: np.einsum("oi,bis->bos", x[0, :, 0, :64], x[:, :, 0, :])[:, :, None, :]  # noqa: E731
    p = single("compile.conv_dynamic_weight", "conv", body, X, ref, -0.5, 0.5, REDUCTION, grade=3,
               ops=("slice_by_size", "reshape", "conv"), what="conv whose weight is computed from the input")
    return _with_expect(p, lambda q: "rejected" if q.reject_dynamic_conv_weight else "ok")


def _matmul_inline() -> Probe:
    body = [op("y", "fp16", (1, 4, 64, 64), "matmul", x="x", y="x", transpose_x="bool(false)",
               transpose_y="bool(true)")]
    p = single("compile.matmul_inline_transpose", "matmul", body, (1, 4, 64, 64),
               lambda x: x @ x.transpose(0, 1, 3, 2), -1, 1, REDUCTION, in_shape=A, grade=3,
               what="matmul with transpose flags written inline")
    return _with_expect(p, lambda q: "rejected" if q.reject_inline_matmul_transpose else "ok")


def _cast_inside() -> Probe:
    body = [const("two", "fp16", 2.0), const("one", "fp32", 1.0), const("half", "fp16", 0.5),
            const("to32", "string", "fp32"), const("to16", "string", "fp16"),
            op("m", "fp16", X, "mul", x="x", y="two"), op("c", "fp32", X, "cast", x="m", dtype="to32"),
            op("d", "fp32", X, "add", x="c", y="one"), op("e", "fp16", X, "cast", x="d", dtype="to16"),
            op("y", "fp16", X, "mul", x="e", y="half")]
    p = single("compile.cast_inside", "cast", body, X, lambda x: x + 0.5, -4, 4, grade=3, ops=("mul", "cast", "add"),
               what="cast to fp32 and back in the middle of the graph")
    return _with_expect(p, lambda q: "rejected" if q.cast_only_at_boundary else "ok")


def _undefined_return(h: Harness) -> Observation:
    text = program([("x", "fp16", X)], [op("y", "fp16", X, "relu", x="x")], ["ghost"])
    h.run(text, [data(X, -1, 1, 61)], [("fp16", X)])
    return Observation("", "ok", detail="compiled and ran a program returning an undefined name")


def _with_expect(p: Probe, rule) -> Probe:
    return Probe(p.name, p.grade, p.what, p.run, expect_ops(p.ops, rule), p.ops)


# ----------------------------------------------------------------------------- semantics


def _sdpa_mask(h: Harness) -> Observation:
    hd = 32
    body = [const("b0", "int32", [0, 0, 0, 0]), const("b1", "int32", [0, 0, 0, hd]), const("b2", "int32", [0, 0, 0, 2 * hd]),
            const("sz", "int32", [1, 4, 64, hd]), blob_const("m", "fp16", (1, 1, 64, 64), "@model_path/weights/mask.bin")]
    body += [op(n, "fp16", (1, 4, 64, hd), "slice_by_size", x="x", begin=b, size="sz")
             for n, b in (("q", "b0"), ("k", "b1"), ("v", "b2"))]
    body.append(op("y", "fp16", (1, 4, 64, hd), "scaled_dot_product_attention", query="q", key="k", value="v",
                   attn_mask="m"))
    x = data(A, -1, 1, 71)
    (got,) = h.run(program([("x", "fp16", A)], body, ["y"]), [x], [("fp16", (1, 4, 64, hd))],
                   weights={"@model_path/weights/mask.bin": blob(causal_mask(64))[0]})
    q, k, v = (f64(x)[..., i * hd:(i + 1) * hd] for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    refs = {"applied": softmax(scores + f64(causal_mask(64))) @ v, "ignored": softmax(scores) @ v}
    errs = {name: rel_err(got, ref) for name, ref in refs.items()}
    best = min(errs, key=errs.get)
    if errs[best] > BLOCK:
        return Observation("", "wrong-result", err=errs[best], tol=BLOCK, detail="matches neither masked nor unmasked")
    return Observation("", "ok", best, errs[best], BLOCK, f"mask {best}")


def _reload(h: Harness) -> Observation:
    path = "@model_path/weights/w.bin"
    text = program([("x", "fp16", X)], [blob_const("w", "fp16", (1, 64, 1, 1), path),
                                        op("y", "fp16", X, "mul", x="x", y="w")], ["y"])
    w_old, w_new = CH.reshape(1, 64, 1, 1).astype(np.float16), -CH.reshape(1, 64, 1, 1).astype(np.float16)
    x = data(X, -2, 2, 81)
    prog = h.compile(text, {path: blob(w_old)[0]})
    prog.load()
    (first,) = prog.run([x], [("fp16", X)])
    if rel_err(first, f64(x) * f64(w_old)) > ELEMENTWISE:
        return Observation("", "wrong-result", err=rel_err(first, f64(x) * f64(w_old)), detail="first run is off")
    prog.rewrite(path, blob(w_new)[0])
    prog.unload()
    prog.load()
    (second,) = prog.run([x], [("fp16", X)])
    for value, w in (("new", w_new), ("old", w_old)):
        if rel_err(second, f64(x) * f64(w)) <= ELEMENTWISE:
            return Observation("", "ok", value, rel_err(second, f64(x) * f64(w)), ELEMENTWISE,
                               f"after rewrite + unload + load the program computes with the {value} weights")
    return Observation("", "wrong-result", detail="after reload: neither the old nor the new weights")


def _multi_chunk(h: Harness) -> Observation:
    w1, w2 = CH.reshape(1, 64, 1, 1).astype(np.float16), (CH - 1).reshape(1, 64, 1, 1).astype(np.float16)
    data_bytes, (o1, o2) = blob(w1, w2)
    path = "@model_path/weights/both.bin"
    body = [blob_const("w1", "fp16", w1.shape, path, o1), blob_const("w2", "fp16", w2.shape, path, o2),
            op("m", "fp16", X, "mul", x="x", y="w1"), op("y", "fp16", X, "add", x="m", y="w2")]
    x = data(X, -2, 2, 91)
    (got,) = h.run(program([("x", "fp16", X)], body, ["y"]), [x], [("fp16", X)], weights={path: data_bytes})
    return compare(got, f64(x) * f64(w1) + f64(w2), ELEMENTWISE)


def _overflow(h: Harness) -> Observation:
    shape = (1, 64, 1, 192)  # fp32 surfaces: 49,152 bytes
    x = np.concatenate([data((1, 32, 1, 192), 1, 60, 101, "fp32"), data((1, 32, 1, 192), 300, 400, 102, "fp32")], 1)
    body = [const("to16", "string", "fp16"), const("to32", "string", "fp32"),
            op("h", "fp16", shape, "cast", x="x", dtype="to16"), op("s", "fp16", shape, "mul", x="h", y="h"),
            op("y", "fp32", shape, "cast", x="s", dtype="to32")]
    (got,) = h.run(program([("x", "fp32", shape)], body, ["y"]), [x], [("fp32", shape)])
    ref = f64(x.astype(np.float16)) ** 2  # 1..3600 in channels 0-31, 90000..160000 (past fp16) in 32-63
    small = rel_err(got[:, :32], ref[:, :32])
    if small <= ELEMENTWISE and np.isinf(got[:, 32:]).all():
        return Observation("", "ok", "fp16", small, ELEMENTWISE, "x*x past 65504 gives inf")
    if rel_err(got, ref) <= ELEMENTWISE:
        return Observation("", "ok", "fp32", rel_err(got, ref), ELEMENTWISE, "x*x past 65504 stays finite")
    return Observation("", "wrong-result", err=rel_err(got, ref), detail="neither fp16 overflow nor fp32 values")


def _saturation(h: Harness) -> Observation:
    sign = np.where(np.arange(384) % 2, 1.0, -1.0)
    x = (data(X, 4200, 6000, 111).astype(np.float64) * sign).astype(np.float16)
    body = [const("b", "int32", [0, 0, 0, 16]), const("sz", "int32", [1, 64, 1, 256]),
            op("y", "fp16", (1, 64, 1, 256), "slice_by_size", x="x", begin="b", size="sz")]
    (got,) = h.run(program([("x", "fp16", X)], body, ["y"]), [x], [("fp16", (1, 64, 1, 256))])
    if np.isinf(got).any():
        return Observation("", "ok", "saturates", detail=f"{int(np.isinf(got).sum())} values past 4200 became inf")
    return compare(got, f64(x)[..., 16:272], ELEMENTWISE)


def semantic_probes() -> list[Probe]:
    def rule(ops, fn):
        return expect_ops(ops, fn)
    return [
        _conv_bias(), _conv_dynamic_weight(), _matmul_inline(), _cast_inside(),
        Probe("compile.undefined_return", 3, "returning a name no statement defines", _undefined_return,
              rule(("relu",), lambda p: "rejected"), ("relu",)),
        Probe("sem.sdpa_mask", 3, "scaled_dot_product_attention with a causal attn_mask: applied or ignored?",
              _sdpa_mask, rule(("slice_by_size", "scaled_dot_product_attention"),
                               lambda p: "ignored" if p.sdpa_ignores_mask else "applied"),
              ("slice_by_size", "scaled_dot_product_attention")),
        # What it measures on a Mac: the framework's unload deletes the folder and the load is
        # served by aned's cache for the hex id (which hashes the original blobs), so "old" says
        # a reload cannot bring new weights; it does not say whether files would be re-read.
        Probe("sem.reload_weights", 3, "rewrite the blob, unload, load: does the reloaded program use the "
              "new weights? (on a Mac the load is served by aned's cache for the original hex id)", _reload,
              rule(("mul",), lambda p: "new" if p.reload_reads_new_weights else "old"), ("mul",)),
        Probe("sem.multi_chunk_blob", 3, "two tensors in one blob file at two offsets", _multi_chunk,
              rule(("mul", "add"), lambda p: "rejected" if p.single_chunk_blobs_only else "ok"), ("mul", "add")),
        Probe("sem.fp16_overflow", 3, "x*x past 65504 between fp32 casts: inf (fp16 compute) or finite?",
              _overflow, rule(("cast", "mul"), lambda p: "fp16" if p.compute_dtype == "fp16" else "fp32"),
              ("cast", "mul")),
        Probe("sem.saturation", 3, "|x| in 4200..6000 through a slice (A13/A14 saturate past 4094)", _saturation,
              rule(("slice_by_size",), lambda p: "saturates" if p.saturate_above is not None
                   and p.saturate_above < 4200 else "ok"), ("slice_by_size",)),
    ]
