"""Grade 3: the conv/matmul accumulator, its limit (32768 in the strict profile) and its precision
(docs/chip-profiles.md).

The sources agree that conv/matmul results at |x| >= 32768 are inf on M1, A14, M4 and M6 and
disagree on the precision (an fp32-class accumulator, or Q15.16 fixed point) and on M5, so every
probe reads the behaviour off exact numbers: each operand and product is an fp16 value and each
sum is exact in both accumulators, so any difference is the accumulator's, not rounding's.

    acc.limit.conv       1x1 conv, 64 equal products per result, results on a ladder of rungs
    acc.limit.matmul     matmul, two equal products per result (16384 + 16384 is one rung)
    acc.precision.cancel partial sums +20000, +40000, +20000, 0, then +3: sticky inf or 3?
    acc.precision.tiny   64 products of exponent sum -17: dropped (fixed point) or kept?

`derive.py` turns the readings into `accumulator_limit` and `accumulator`.
"""

from __future__ import annotations

import numpy as np

from .harness import ELEMENTWISE, Harness, Observation, Probe, blob, f64, rel_err
from .milgen import blob_const, op, program
from .probes_ops import X, expect_ops
from .probes_semantics import CONV_ARGS, CONV_CONSTS

RUNGS = (16384.0, 24576.0, 32752.0, 32768.0, 49152.0, 65504.0)  # 32752 and 32768 are adjacent fp16 values
LIMIT_PROBES = ("acc.limit.conv", "acc.limit.matmul")
CANCEL, TINY = "acc.precision.cancel", "acc.precision.tiny"
CANCEL_PEAK = 40000.0  # the largest partial sum of the cancel probe
M = (1, 1, 64, 64)  # matmul operands and results: [1, 1, rows, K] @ [1, 1, K, columns]
W_PATH = "@model_path/weights/w.bin"
SIGN = np.where(np.arange(64) % 2, -1.0, 1.0)  # odd rows (or columns) negative: -inf is checked too


def first_limited_rung(limit: float | None, saturate_above: float | None = None, rungs=RUNGS) -> str:
    """The reading a device with this accumulator limit gives: the first rung that is inf.
    Saturating activations (A13/A14: |x| > 4094 is inf) hide the limit below them."""
    return next((str(int(r)) for r in rungs if (limit is not None and r >= limit)
                 or (saturate_above is not None and r > saturate_above)), "none")


def ladder_expect(p) -> str:
    return first_limited_rung(p.accumulator_limit, p.saturate_above)


def _matmul(h: Harness, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (the input) @ w (a BLOBFILE const), both [1, 1, 64, 64] fp16."""
    body = [blob_const("w", "fp16", M, W_PATH), op("y", "fp16", M, "matmul", x="x", y="w")]
    (got,) = h.run(program([("x", "fp16", M)], body, ["y"]), [x.astype(np.float16)], [("fp16", M)],
                   weights={W_PATH: blob(w.astype(np.float16))[0]})
    return f64(got)


def read_ladder(got: np.ndarray, rung_of: np.ndarray, sign: np.ndarray, rungs=RUNGS) -> Observation:
    """got: results whose exact value is sign · rungs[rung_of]. The reading is the first rung
    that came out inf with the right sign; every smaller rung exact, every larger inf too."""
    states = []
    for i, r in enumerate(rungs):
        sel = rung_of == i
        g, ref = got[sel], sign[sel] * r
        if rel_err(g, ref) <= ELEMENTWISE:
            states.append("finite")
        elif np.array_equal(g, np.copysign(np.inf, ref)):
            states.append("inf")
        else:
            return Observation("", "wrong-result", err=rel_err(g, ref), tol=ELEMENTWISE,
                               detail=f"results of {r:g}: neither the value nor a signed inf")
    if "inf" in states and "finite" in states[states.index("inf"):]:
        return Observation("", "wrong-result", detail=f"inf and finite rungs interleave: {states}")
    if "inf" not in states:
        return Observation("", "ok", "none", detail=f"every result up to {rungs[-1]:g} is finite")
    first = rungs[states.index("inf")]
    below = rungs[states.index("inf") - 1] if states.index("inf") else 0.0
    return Observation("", "ok", str(int(first)), detail=f"{below:g} passes, {first:g} is inf")


def _limit_conv(h: Harness) -> Observation:
    rung_of = np.arange(64) % len(RUNGS)  # per output channel
    w = np.repeat((np.array(RUNGS)[rung_of] / 1024)[:, None], 64, 1).reshape(64, 64, 1, 1)  # exact fp16
    x = np.broadcast_to(16.0 * np.resize(SIGN, 384), X).astype(np.float16)  # 64 products of rung/64
    body = [blob_const("W", "fp16", w.shape, W_PATH), *CONV_CONSTS,
            op("y", "fp16", X, "conv", x="x", weight="W", **CONV_ARGS)]
    (got,) = h.run(program([("x", "fp16", X)], body, ["y"]), [x], [("fp16", X)],
                   weights={W_PATH: blob(w.astype(np.float16))[0]})
    shape = np.broadcast_shapes(X)
    return read_ladder(f64(got), np.broadcast_to(rung_of[None, :, None, None], shape),
                        np.broadcast_to(np.resize(SIGN, 384), shape))


def _limit_matmul(h: Harness) -> Observation:
    rung_of = np.arange(64) % len(RUNGS)  # per column
    x, w = np.zeros(M), np.zeros(M)
    x[0, 0, :, :2] = 128.0 * SIGN[:, None]
    w[0, 0, :2, :] = np.array(RUNGS)[rung_of] / 256  # two products of rung/2 each: every product finite
    got = _matmul(h, x, w)
    return read_ladder(got, np.broadcast_to(rung_of, M), np.broadcast_to(SIGN[:, None], M))


def _cancel(h: Harness) -> Observation:
    x, w = np.zeros(M), np.zeros(M)
    x[0, 0, :, :5] = np.array([100.0, 100.0, -100.0, -100.0, 1.0]) * SIGN[:, None]
    w[0, 0, :5, :] = np.array([200.0, 200.0, 200.0, 200.0, 3.0])[:, None]
    got, ref = _matmul(h, x, w), 3.0 * np.broadcast_to(SIGN[:, None], M)
    if rel_err(got, ref) <= ELEMENTWISE:
        return Observation("", "ok", "cancels", rel_err(got, ref), ELEMENTWISE,
                           "a partial sum of 40000 cancelled: only the result is limited")
    if np.array_equal(got, np.copysign(np.inf, ref)):
        return Observation("", "ok", "sticky", detail="a partial sum of 40000 made the result inf")
    return Observation("", "wrong-result", err=rel_err(got, ref), tol=ELEMENTWISE, detail="neither 3 nor inf")


def _tiny(h: Harness) -> Observation:
    # x = 2^-8 in even rows, 1.5 · 2^-8 in odd rows; by column (mod 4), w = 2^-9 (exponent sum
    # -17), 2^-8 (-16: on the grid), 1.5 · 2^-8 (1.5 LSB), 1.5 · 2^-9 (-17, yet 1.125 LSB in odd rows)
    x = np.full(M, 2.0**-8)
    x[0, 0, 1::2, :] *= 1.5
    w = np.zeros(M)
    w[..., 0::4], w[..., 1::4], w[..., 2::4], w[..., 3::4] = 2.0**-9, 2.0**-8, 1.5 * 2.0**-8, 1.5 * 2.0**-9
    got = _matmul(h, x, w)
    exact = 64 * x[..., :1] * w  # every product times 64: exact in fp16
    kept, half = np.s_[0, 0, 0::2, 1::4], np.s_[0, 0, 0::2, 2::4]  # even rows: whole LSBs, 1.5 LSB
    small = np.zeros(M, bool)
    small[..., 0::4] = small[..., 3::4] = True
    if rel_err(got[kept], exact[kept]) > ELEMENTWISE:
        return Observation("", "wrong-result", err=rel_err(got[kept], exact[kept]), tol=ELEMENTWISE,
                           detail="products of exactly 2^-16 came out wrong")
    r = float(np.mean(got[half] / exact[half]))
    grid = min(((1.0, "exact"), (2 / 3, "truncated to 1 LSB"), (4 / 3, "rounded to 2 LSB")),
               key=lambda kv: abs(kv[0] - r))[1]
    if (got[small] == 0).all():
        return Observation("", "ok", "dropped", detail=f"products under 2^-15 dropped; 1.5-LSB products {grid}")
    if rel_err(got[small], exact[small]) <= ELEMENTWISE:
        return Observation("", "ok", "kept", rel_err(got[small], exact[small]), ELEMENTWISE,
                           f"products of 2^-17 kept; 1.5-LSB products {grid}")
    return Observation("", "wrong-result", err=rel_err(got[small], exact[small]), tol=ELEMENTWISE,
                       detail="products of exponent sum -17: neither dropped nor summed")


def accumulator_probes() -> list[Probe]:
    conv_ops, mm_ops = ("conv",), ("matmul",)
    return [
        Probe("acc.limit.conv", 3, "1x1 conv results from 16384 to 65504: the first that is inf (32752 vs 32768)",
              _limit_conv, expect_ops(conv_ops, ladder_expect), conv_ops),
        Probe("acc.limit.matmul", 3, "matmul results as sums of two products (16384 + 16384): the first inf",
              _limit_matmul, expect_ops(mm_ops, ladder_expect), mm_ops),
        Probe(CANCEL, 3, "matmul partial sums +20000, +40000, +20000, 0, +3: inf (q15.16) or 3 (fp32)?", _cancel,
              expect_ops(mm_ops, lambda p: "sticky" if p.accumulator == "q15.16" and p.accumulator_limit is not None
                         and p.accumulator_limit <= CANCEL_PEAK else "cancels"), mm_ops),
        Probe(TINY, 3, "matmul of 64 products of exponent sum -17: dropped (q15.16) or kept (fp32)?", _tiny,
              expect_ops(mm_ops, lambda p: "dropped" if p.accumulator == "q15.16" else "kept"), mm_ops),
    ]
