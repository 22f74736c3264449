"""Grade 3: the int8 path (docs/quantization.md), in the W8A8 form our compiler emits.

    int8.quantize_rounding  quantize of exact ties (x/s = k + 1/2) and of values past the int8
                            range: half to even or half away from zero, and saturation
    int8.accumulator        W8A8 conv (quantize -> dequantize -> conv on constexpr int8 weights)
                            whose integer sums reach 516,096 before the row scale brings the
                            results to 16384 ... 64512: int32 (every result exact) or a limit
    op.constexpr_blockwise_shift_scale   a 1x1 conv on 4-bit weights (W4, `anelm quantize
                            --scheme w4`): uint4 BLOBFILE data in blocks of 32 inputs with fp16
                            scales and offsets, made dense at compile time (iOS 18)
    op.constexpr_lut_to_dense  a 1x1 conv on palettized weights (`--scheme lut4|lut6`): uint6
                            BLOBFILE indices into fp16 tables of 64, one per row and 32 inputs

The sources disagree on the rounding (MIL's reference rounds half to even; the M6 study reports
half away from zero for the accumulator's outputs), so the first probe reads it off numbers
where the two differ; `derive.py` sets `quantize_rounding` from it. The second checks what the
sources agree on (the int8 path sums in int32, results up to 64512 are fine): no profile
switch follows from it, and a limited reading is recorded as an anomaly.
"""

from __future__ import annotations

import numpy as np

from .harness import REDUCTION, Harness, Observation, Probe, blob, compare, data, f64
from .milgen import const, literal, op, program, ttype
from .probes_accum import first_limited_rung, read_ladder
from .probes_ops import X, expect_ops
from .probes_semantics import CONV_ARGS, CONV_CONSTS

ROUNDING, ACCUM = "int8.quantize_rounding", "int8.accumulator"
S_X = 0.5  # the activation scale: a power of two, so x / s is exact and a tie stays a tie
# x / s: ties on both signs and at the range's ends (127.5 and -128.5 saturate either way),
# values near a tie that are not ties, and values far past the range
STEPS = np.array([0.5, 1.5, 2.5, 3.5, 126.5, 127.5, -0.5, -1.5, -2.5, -126.5, -127.5, -128.5,
                  0.25, 0.75, -1.25, 5.0, 200.0, -200.0, 1000.0, -1000.0])
INT8_RUNGS = (16384.0, 32752.0, 32768.0, 49152.0, 64512.0)  # results of the accumulator probe
ROW_SCALE = 0.25  # each result's integer sum is rung / (S_X · ROW_SCALE): 131,072 ... 516,096
Q_X = 64.0  # every int8 activation; the sum over 64 channels is Q_X · Σ_k q[o, k]
W_PATH = "@model_path/weights/q.bin"


def quantize_reference(steps: np.ndarray, rounding: str) -> np.ndarray:
    """int8 of x / s = steps under `rounding` (the profile's names), saturated at [-128, 127]."""
    nearest = np.floor(steps + 0.5)  # ties upward; the two modes differ only at ties
    tie = steps + 0.5 == nearest
    if rounding == "half_even":
        nearest = np.where(tie & (nearest % 2 != 0), nearest - 1, nearest)
    else:  # half_away: a negative tie goes down
        nearest = np.where(tie & (steps < 0), nearest - 1, nearest)
    return np.clip(nearest, -128, 127)


MODES = ("half_even", "half_away")


def _quantize_pair(x: str, scale: float, out: str) -> list[str]:
    """x -> quantize(scale) -> dequantize(scale) -> `out`, the activations' pattern (kernels/qlinear.py)."""
    return [const("s", "fp16", scale), const("dt", "string", "int8"),
            op("xq", "int8", X, "quantize", input=x, output_dtype="dt", scale="s"),
            op(out, "fp16", X, "dequantize", input="xq", scale="s")]


def _rounding(h: Harness) -> Observation:
    steps = np.resize(STEPS, X[1] * X[3]).reshape(X[1], X[3])[None, :, None, :]
    x = (steps * S_X).astype(np.float16)
    assert np.array_equal(f64(x) / S_X, steps)  # every value exact in fp16: the ties are ties
    (got,) = h.run(program([("x", "fp16", X)], _quantize_pair("x", S_X, "y"), ["y"]), [x], [("fp16", X)])
    q = f64(got) / S_X
    for mode in MODES:
        if np.array_equal(q, quantize_reference(steps, mode)):
            return Observation("", "ok", mode, detail=f"ties rounded {mode.replace('_', ' ')}; saturated at -128, 127")
    off = (q != quantize_reference(steps, MODES[0])) & (q != quantize_reference(steps, MODES[1]))
    firsts = ", ".join(f"{a:g} -> {b:g}" for a, b in list(zip(steps[off], q[off]))[:4])
    return Observation("", "wrong-result", detail=f"x/s read back as neither rounding gives: {firsts or 'mixed modes'}")


def accumulator_weights() -> tuple[np.ndarray, np.ndarray]:
    """(int8 weights [64, 64, 1, 1], the rung index of each output channel): row o sums to
    rung / (S_X · ROW_SCALE · Q_X), spread over the 64 inputs with every entry under 127."""
    rung_of = np.arange(64) % len(INT8_RUNGS)
    total = (np.array(INT8_RUNGS)[rung_of] / (S_X * ROW_SCALE * Q_X)).astype(np.int64)  # 2048 ... 8064
    q = total[:, None] // 64 + (np.arange(64)[None, :] < total[:, None] % 64)
    assert np.array_equal(q.sum(axis=1), total) and q.max() <= 127
    return q.astype(np.int8).reshape(64, 64, 1, 1), rung_of


def _accumulator(h: Harness) -> Observation:
    q, rung_of = accumulator_weights()
    sign = np.where(np.arange(X[3]) % 2, -1.0, 1.0)  # odd columns negative: -inf is read too
    x = np.broadcast_to(Q_X * S_X * sign, X).astype(np.float16)  # quantizes to ±64 exactly
    weight = (f'{ttype("fp16", q.shape)} W = constexpr_affine_dequantize()[axis = int32(0), name = string("W"), '
              f'quantized_data = {ttype("int8", q.shape)}(BLOBFILE(path = string("{W_PATH}"), offset = uint64(64))), '
              f'scale = {literal("fp16", np.full(64, ROW_SCALE))}, zero_point = int8(0)];')
    body = [weight, *_quantize_pair("x", S_X, "xd"), *CONV_CONSTS,
            op("y", "fp16", X, "conv", x="xd", weight="W", **CONV_ARGS)]
    (got,) = h.run(program([("x", "fp16", X)], body, ["y"]), [x], [("fp16", X)], weights={W_PATH: blob(q)[0]})
    obs = read_ladder(f64(got), np.broadcast_to(rung_of[None, :, None, None], X),
                      np.broadcast_to(sign, X), INT8_RUNGS)
    if obs.value == "none":
        obs.detail = f"integer sums up to {INT8_RUNGS[-1] / (S_X * ROW_SCALE):,.0f}, results up to {INT8_RUNGS[-1]:g}: exact"
    return obs


INT8_OPS = ("quantize", "dequantize", "constexpr_affine_dequantize", "conv")
W4, W4_OPS = "op.constexpr_blockwise_shift_scale", ("constexpr_blockwise_shift_scale", "conv")


def w4_weights() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(uint4 data [96, 64, 1, 1], fp16 scale and offset [96, 2, 1, 1], the dense weight in
    float64). Scales are powers of two and offsets quarters, so every q − offset and product
    is exact in fp16: the dense weight is the definition's, scale · (data − offset), whatever
    the order of its roundings, and the probe's tolerance is the conv's alone."""
    rng = np.random.default_rng(34)
    q = rng.integers(0, 16, (96, 64, 1, 1)).astype(np.uint8)
    scale = (2.0 ** rng.integers(-9, -5, (96, 2, 1, 1))).astype(np.float16)
    offset = (rng.integers(0, 64, (96, 2, 1, 1)) / 4).astype(np.float16)  # 0 .. 15.75
    dense = (q - np.repeat(f64(offset), 32, axis=1)) * np.repeat(f64(scale), 32, axis=1)
    return q, scale, offset, dense


def _w4(h: Harness) -> Observation:
    from ..mil.blob import encode_tensor  # noqa: PLC0415 - the harness reaches the blob writer lazily

    q, scale, offset, dense = w4_weights()
    x = data(X, -1.0, 1.0, 34)
    out = (1, 96, 1, X[3])
    weight = (f'{ttype("fp16", q.shape)} W = constexpr_blockwise_shift_scale()['
              f'data = {ttype("uint4", q.shape)}(BLOBFILE(path = string("{W_PATH}"), offset = uint64(64))), '
              f'name = string("W"), offset = {literal("fp16", offset)}, scale = {literal("fp16", scale)}];')
    body = [weight, *CONV_CONSTS, op("y", "fp16", out, "conv", x="x", weight="W", **CONV_ARGS)]
    (got,) = h.run(program([("x", "fp16", X)], body, ["y"]), [x], [("fp16", out)],
                   weights={W_PATH: bytes(encode_tensor(q, "uint4"))})
    ref = np.einsum("oi,bis->bos", dense[:, :, 0, 0], f64(x)[:, :, 0, :])[:, :, None, :]
    return compare(got, ref, REDUCTION)


LUT, LUT_OPS = "op.constexpr_lut_to_dense", ("constexpr_lut_to_dense", "conv")
LUT_PATH = "@model_path/weights/lut.bin"


def lut_weights() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint6 indices [32, 64, 1, 1], fp16 tables [32, 2, 1, 1, 64, 1], the dense weight in
    float64). Each row and half row has its own table, so an op that shares tables wrongly or
    unpacks 6-bit indices at another stride reads other entries; entries are multiples of 2^-8."""
    rng = np.random.default_rng(35)
    idx = rng.integers(0, 64, (32, 64, 1, 1)).astype(np.uint8)
    lut = (rng.integers(-256, 256, (32, 2, 1, 1, 64, 1)) / 256).astype(np.float16)
    dense = f64(lut)[np.arange(32)[:, None], np.arange(64)[None, :] // 32, 0, 0, idx[:, :, 0, 0], 0]
    return idx, lut, dense[:, :, None, None]


def _lut(h: Harness) -> Observation:
    from ..mil.blob import encode_tensor  # noqa: PLC0415 - the harness reaches the blob writer lazily

    idx, lut, dense = lut_weights()
    x = data(X, -1.0, 1.0, 35)
    out = (1, 32, 1, X[3])
    weight = (f'{ttype("fp16", idx.shape)} W = constexpr_lut_to_dense()['
              f'indices = {ttype("uint6", idx.shape)}(BLOBFILE(path = string("{W_PATH}"), offset = uint64(64))), '
              f'lut = {ttype("fp16", lut.shape)}(BLOBFILE(path = string("{LUT_PATH}"), offset = uint64(64))), '
              'name = string("W")];')
    body = [weight, *CONV_CONSTS, op("y", "fp16", out, "conv", x="x", weight="W", **CONV_ARGS)]
    (got,) = h.run(program([("x", "fp16", X)], body, ["y"]), [x], [("fp16", out)],
                   weights={W_PATH: bytes(encode_tensor(idx, "uint6")), LUT_PATH: bytes(encode_tensor(lut))})
    ref = np.einsum("oi,bis->bos", dense[:, :, 0, 0], f64(x)[:, :, 0, :])[:, :, None, :]
    return compare(got, ref, REDUCTION)


def int8_probes() -> list[Probe]:
    qops = ("quantize", "dequantize")
    return [
        Probe(ROUNDING, 3, "quantize of exact ties and out-of-range values: half to even or away from zero?",
              _rounding, expect_ops(qops, lambda p: p.quantize_rounding), qops),
        Probe(ACCUM, 3, "W8A8 conv, integer sums to 516,096, results 16384 to 64512: the first inf (int32: none)",
              _accumulator, expect_ops(INT8_OPS, lambda p: first_limited_rung(None, p.saturate_above, INT8_RUNGS)),
              INT8_OPS),
        Probe(W4, 1, "1x1 conv on uint4 BLOBFILE weights, blocks of 32 with fp16 scales and offsets (iOS 18)",
              _w4, expect_ops(W4_OPS), W4_OPS),
        Probe(LUT, 1, "1x1 conv on uint6 BLOBFILE indices into fp16 tables of 64 per row and 32 inputs (iOS 18)",
              _lut, expect_ops(LUT_OPS), LUT_OPS),
    ]
