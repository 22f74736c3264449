"""The conv/matmul accumulator (the accumulator limit of 32768, docs/chip-profiles.md) in the emulator.

The q15.16 reference below is written from the profile's description in plain Python with exact
rationals (`Fraction`), one product at a time, and shares nothing with the emulator's
vectorised float64 code: products with exponent sum at most -17 are dropped, the rest are
truncated toward zero to multiples of 2^-16 (our reading, stated in device/emulator/accum.py)
and added in order; a partial sum reaching the limit makes the result inf with its sign.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from emulator_testkit import STRICT_NB
from emulator_testkit import run as run_once

from anelm.chip.profile import load_profile
from anelm.doctor.milgen import blob_const, const, op, program
from anelm.mil.blob import encode_tensor

Q1516 = STRICT_NB.replace(name="q15.16", accumulator="q15.16")
UNLIMITED = STRICT_NB.replace(name="unlimited", accumulator_limit=None)
WITH_BIAS = Q1516.replace(reject_conv_bias=False)
CONV_CONSTS = [const("st", "int32", [1, 1]), const("pt", "string", "valid"), const("pd", "int32", [0, 0, 0, 0]),
               const("dl", "int32", [1, 1]), const("gr", "int32", 1)]
CONV_ARGS = dict(strides="st", pad_type="pt", pad="pd", dilations="dl", groups="gr")
W_PATH = "@model_path/weights/w.bin"


def run(text, inputs, profile, weights=None):
    return run_once(text, inputs, weights, profile)


def conv1x1(x: np.ndarray, w: np.ndarray, profile) -> np.ndarray:
    """y = conv(x [1, C, 1, S], W [OC, C, 1, 1] from a BLOBFILE), fp16 in and out."""
    oc, s = w.shape[0], x.shape[-1]
    body = [blob_const("W", "fp16", w.shape, W_PATH), *CONV_CONSTS,
            op("y", "fp16", (1, oc, 1, s), "conv", x="x", weight="W", **CONV_ARGS)]
    text = program([("x", "fp16", x.shape)], body, ["y"])
    return run(text, {"x": x}, profile, {W_PATH: encode_tensor(w.astype(np.float16))})["y"].astype(np.float64)


def matmul(x: np.ndarray, y: np.ndarray, profile) -> np.ndarray:
    """x @ y, both fp16 inputs."""
    shape = x.shape[:-1] + y.shape[-1:]
    text = program([("x", "fp16", x.shape), ("y", "fp16", y.shape)], [op("z", "fp16", shape, "matmul", x="x", y="y")],
                   ["z"])
    return run(text, {"x": x, "y": y}, profile)["z"].astype(np.float64)


def reference_q1516(products: list[float], limit: float | None, init: float = 0.0) -> float:
    """One q15.16 result from its products in contraction order (contract text, exact rationals)."""
    lsb = Fraction(1, 2**16)
    acc = Fraction(math.trunc(Fraction(init) / lsb)) * lsb
    for a, b in products:
        if a == 0 or b == 0:
            continue
        ea, eb = math.frexp(a)[1] - 1, math.frexp(b)[1] - 1  # floor(log2|.|)
        if ea + eb <= -17:
            continue  # dropped
        acc += math.trunc(Fraction(a) * Fraction(b) / lsb) * lsb
        if limit is not None and abs(acc) >= limit:
            return math.copysign(math.inf, acc)
    return float(np.float16(float(acc)))  # |acc| < 2^15 on a 2^-16 grid: float(acc) is exact


# ----------------------------------------------------------------------------- the limit


@pytest.mark.parametrize("profile", [STRICT_NB, Q1516], ids=["fp32", "q15.16"])
def test_conv_result_at_32752_passes_and_at_32768_is_inf(profile):
    # 64 products of 16 x w: the sums are exact in both accumulators
    w = np.zeros((4, 64, 1, 1), np.float16)
    w[:, :, 0, 0] = np.array([32752, 32768, 16384, 65504])[:, None] / 1024
    x = np.full((1, 64, 1, 32), 16.0, np.float16)
    x[..., 1::2] = -16
    y = conv1x1(x, w, profile)
    sign = np.where(np.arange(32) % 2, -1.0, 1.0)
    assert np.array_equal(y[0, 0, 0], 32752 * sign)
    assert np.array_equal(y[0, 1, 0], np.inf * sign)  # -32768 is -inf
    assert np.array_equal(y[0, 2, 0], 16384 * sign)
    assert np.isinf(y[0, 3, 0]).all()
    assert np.isfinite(conv1x1(x, w, UNLIMITED)).all()  # the same program without the limit


@pytest.mark.parametrize("profile", [STRICT_NB, Q1516], ids=["fp32", "q15.16"])
def test_matmul_sum_of_two_16384_products_is_inf(profile):
    x = np.zeros((1, 1, 16, 32), np.float16)
    x[..., :2] = 128.0
    y = np.zeros((1, 1, 32, 16), np.float16)
    y[..., :2, :] = np.array([127.9375, 128.0] * 8)  # products 16376 and 16384
    z = matmul(x, y, profile)
    assert np.array_equal(z[..., 0::2], np.full((1, 1, 16, 8), 32752.0))
    assert np.isposinf(z[..., 1::2]).all()  # 16384 + 16384, each product finite
    assert np.array_equal(matmul(-x, y, profile)[..., 1::2], np.full((1, 1, 16, 8), -np.inf))
    assert np.array_equal(matmul(x, y, UNLIMITED)[..., 1::2], np.full((1, 1, 16, 8), 32768.0))


def test_elementwise_results_overflow_only_past_65504():
    text = program([("x", "fp16", (1, 4, 1, 16))], [const("k", "fp16", 200.0), op("y", "fp16", (1, 4, 1, 16), "mul",
                                                                                      x="x", y="k")], ["y"])
    y = run(text, {"x": np.full((1, 4, 1, 16), 256.0, np.float16)}, STRICT_NB)["y"]
    assert (y == 51200).all()  # past the accumulator's 32768: an elementwise op is not limited


def test_permissive_profile_is_unaffected():
    p = load_profile("permissive-test").replace(compile_budget=10**9)
    assert p.accumulator_limit is None and p.accumulator == "fp32"
    x = np.zeros((1, 1, 16, 32), np.float16)
    x[..., :2] = 200.0
    y = np.full((1, 1, 32, 16), 100.0, np.float16)
    assert (matmul(x, y, p) == 40000).all()  # no limit (and fp32 compute)


def test_strict_profile_file_matches_the_builtin():
    strict = load_profile(str(load_profile.__globals__["PROFILE_DIR"] / "strict.json"))
    assert strict.accumulator_limit == 32768 and strict.accumulator == "fp32"


# ----------------------------------------------------------------------------- the precision


def test_partial_sum_that_cancels_passes_under_fp32_and_is_inf_under_q1516():
    # products in order: +20000, +20000, -20000, -20000, +3 (partial sums reach 40000)
    x = np.zeros((1, 1, 16, 16), np.float16)
    x[..., :5] = [100.0, 100.0, -100.0, -100.0, 1.0]
    y = np.zeros((1, 1, 16, 16), np.float16)
    y[..., :5, :] = np.array([200.0, 200.0, 200.0, 200.0, 3.0])[:, None]
    assert (matmul(x, y, STRICT_NB) == 3).all()
    assert np.isposinf(matmul(x, y, Q1516)).all()
    order = [0, 2, 1, 3, 4, *range(5, 16)]  # +20000, -20000, +20000, -20000, +3: partial sums stay small
    assert (matmul(x[..., order], y[..., order, :], Q1516) == 3).all()


def test_tiny_products_are_dropped_under_q1516():
    # 64 products each of exponent sum -17 (2^-8 · 2^-9), -16 (2^-8 · 2^-8), or 1.5 · 2^-16
    x = np.full((1, 1, 16, 64), 2.0**-8, np.float16)
    y = np.zeros((1, 1, 64, 16), np.float16)
    y[..., 0:4] = 2.0**-9
    y[..., 4:8] = 2.0**-8
    y[..., 8:12] = 1.5 * 2.0**-8
    fp32, q = matmul(x, y, STRICT_NB), matmul(x, y, Q1516)
    assert np.array_equal(fp32[..., 0:4], np.full((1, 1, 16, 4), 64 * 2.0**-17))
    assert (q[..., 0:4] == 0).all()  # dropped
    assert (q[..., 4:8] == 64 * 2.0**-16).all() and (fp32[..., 4:8] == 64 * 2.0**-16).all()  # kept
    assert (q[..., 8:12] == 64 * 2.0**-16).all()  # 1.5 LSB truncated to 1 LSB
    assert (fp32[..., 8:12] == 1.5 * 64 * 2.0**-16).all()
    # exponent sum -17 but magnitude 1.125 · 2^-16 (1.5 · 2^-8 times 1.5 · 2^-9): dropped, not one LSB
    y[..., 0:4] = 1.5 * 2.0**-9
    assert (matmul(1.5 * x, y, Q1516)[..., 0:4] == 0).all()
    assert (matmul(1.5 * x, y, STRICT_NB)[..., 0:4] == 64 * 1.125 * 2.0**-16).all()


def _mixed(rng, shape, lo=-12, hi=6):
    """fp16 values over binades 2^lo .. 2^hi, both signs: products on both sides of 2^-16."""
    mag = 2.0 ** rng.uniform(lo, hi, shape) * rng.choice([-1, 1], shape)
    return mag.astype(np.float16)


# (-12, 6): results up to the limit; (-10, -4): results near 2^-6, where fp16 resolves one LSB,
# so dropping, truncating and rounding the products give different results
@pytest.mark.parametrize("lo, hi, differ", [(-12, 6, 0.0), (-10, -4, 0.2)])
def test_q1516_matmul_matches_the_reference_on_random_data(lo, hi, differ):
    rng = np.random.default_rng(3)
    x, y = _mixed(rng, (1, 2, 16, 24), lo, hi), _mixed(rng, (1, 2, 24, 16), lo, hi)
    x[0, 0, 0, :], y[0, 0, :, 0] = 200.0, 64.0  # one result whose partial sums reach the limit
    got = matmul(x, y, Q1516)
    ref = np.array([[[[reference_q1516([(float(x[0, h, i, k]), float(y[0, h, k, j])) for k in range(24)], 32768)
                       for j in range(16)] for i in range(16)] for h in range(2)]])
    assert np.array_equal(got, ref)  # bit for bit: both are exact until the one rounding to fp16
    assert np.isinf(got).any() and (got != matmul(x, y, STRICT_NB)).mean() > differ


def test_q1516_conv_3x3_with_bias_matches_the_reference():
    rng = np.random.default_rng(4)
    x, w, b = _mixed(rng, (1, 4, 5, 6)), _mixed(rng, (3, 4, 3, 3)), _mixed(rng, (3,))
    body = [blob_const("W", "fp16", w.shape, W_PATH), const("b", "fp16", b), *CONV_CONSTS,
            op("y", "fp16", (1, 3, 3, 4), "conv", x="x", weight="W", bias="b", **CONV_ARGS)]
    text = program([("x", "fp16", x.shape)], body, ["y"])
    got = run(text, {"x": x}, WITH_BIAS, {W_PATH: encode_tensor(w)})["y"].astype(np.float64)
    for o in range(3):
        for i in range(3):
            for j in range(4):
                # contraction order: kernel taps (row, column), then input channels
                prods = [(float(w[o, c, di, dj]), float(x[0, c, i + di, j + dj]))
                         for di in range(3) for dj in range(3) for c in range(4)]
                assert got[0, o, i, j] == reference_q1516(prods, 32768, init=float(b[o])), (o, i, j)


# ----------------------------------------------------------------------------- attention


def _sdpa(q, k, v, profile):
    shape = q.shape[:-1] + v.shape[-1:]
    text = program([("k", "fp16", k.shape), ("q", "fp16", q.shape), ("v", "fp16", v.shape)],
                   [op("o", "fp16", shape, "scaled_dot_product_attention", query="q", key="k", value="v")], ["o"])
    return run(text, {"q": q, "k": k, "v": v}, profile)["o"].astype(np.float64)


@pytest.mark.parametrize("profile", [STRICT_NB, Q1516], ids=["fp32", "q15.16"])
def test_attention_products_are_limited(profile):
    q = k = np.zeros((1, 2, 16, 16), np.float16)  # uniform attention over 16 keys: p = 1/16 exactly
    assert (_sdpa(q, k, np.full((1, 2, 16, 16), 32000.0, np.float16), profile) == 32000).all()
    assert np.isposinf(_sdpa(q, k, np.full((1, 2, 16, 16), 33024.0, np.float16), profile)).all()  # p·v sum
    assert (_sdpa(q, k, np.full((1, 2, 16, 16), 33024.0, np.float16), UNLIMITED) == 33024).all()
    big = np.full((1, 2, 16, 16), 48.0, np.float16)  # q·k = 16 · 48² = 36864 before the 1/4 scale
    assert not np.isfinite(_sdpa(big, big, big, profile)).any()
    assert np.allclose(_sdpa(big, big, big, UNLIMITED), 48.0)
