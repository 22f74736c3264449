"""The emulator's int8 semantics (device/emulator/int8.py) against an integer numpy reference.

The reference never forms a float sum: fp16 activations are exact multiples of 2^-24, so
x·2^24 is an int64, and Σ q·x is an int64 dot product, divided back once; W8A8 is an int64 dot
product of the int8 operands. Both are rounded to fp16 once by numpy's float64 -> float16
cast. Agreement is asserted bit for bit (equal fp16 bit patterns, inf included).
"""

import numpy as np
import pytest

from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.ir.builder import GraphBuilder
from anelm.mil.blob import blob_chunks
from anelm.kernels.qlinear import QLinear, quant_linear
from anelm.runtime.kernel import Kernel

C, O, S = 96, 40, 16


def _run(ql: QLinear, x: np.ndarray, profile=STRICT):
    b = GraphBuilder("int8")
    xin = b.input("x", [1, C, 1, x.shape[1]])
    b.output("y", quant_linear(b, xin, ql, None, "lin"))
    art = compile_graph(b.build(), profile)
    return art, Kernel(art, Emulator(profile))(x=x.reshape(1, C, 1, -1))["y"].reshape(O, -1)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float16).view(np.uint16)


def ref_w8(q, scale16, x16, limit=32768.0):
    xi = (x16.astype(np.float64) * 2.0 ** 24).astype(np.int64)  # exact: fp16 is a multiple of 2^-24
    acc = (q.astype(np.int64) @ xi).astype(np.float64) / 2.0 ** 24
    acc = np.where(np.abs(acc) >= limit, np.copysign(np.inf, acc), acc)
    with np.errstate(over="ignore", invalid="ignore"):
        return (acc * scale16.astype(np.float64)[:, None]).astype(np.float16)


def ref_quantize(x16, s, away=False):
    v = x16.astype(np.float64) / float(s)
    r = np.copysign(np.floor(np.abs(v) + 0.5), v) if away else np.rint(v)
    return np.clip(r, -128, 127).astype(np.int64)


def ref_w8a8(q, scale16, x16, s_x, away=False):
    acc = q.astype(np.int64) @ ref_quantize(x16, s_x, away)
    with np.errstate(over="ignore"):
        return (acc.astype(np.float64) * float(s_x) * scale16.astype(np.float64)[:, None]).astype(np.float16)


def _case(seed, x_scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, size=(O, C)).astype(np.int8)
    scale = (rng.uniform(0.5, 2.0, O) * 2.0 ** -9).astype(np.float16)
    x = (rng.standard_normal((C, S)) * x_scale).astype(np.float16)
    return q, scale, x


@pytest.mark.parametrize("seed,shift", [(0, 1.0), (1, 1.0), (2, 4.0)])
def test_w8_matches_integer_reference_bit_for_bit(seed, shift):
    q, scale, x = _case(seed, x_scale=30.0)  # sums reach past 32768: some results are inf
    ql = QLinear(q, scale.astype(np.float32) / np.float32(shift), shift=shift)
    _, got = _run(ql, x.astype(np.float32))
    xs = (x.astype(np.float32) / shift).astype(np.float16)  # the kernel's exact power-of-two shift
    want = ref_w8(q, (scale.astype(np.float32)).astype(np.float16), xs)
    assert np.isinf(want).any() == (shift == 1.0)  # the limit acts on the unscaled sum
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_w8_limit_applies_before_the_row_scale():
    q = np.full((O, C), 127, np.int8)
    x = np.full((C, S), 3.0, np.float16)  # Σ q·x = 127·3·96 = 36,576 >= 32768
    ql = QLinear(q, np.full(O, 2.0 ** -10, np.float32))  # the output would be a harmless 35.7
    _, got = _run(ql, x.astype(np.float32))
    assert np.isinf(got).all() and (got > 0).all()


@pytest.mark.parametrize("rounding", ["half_even", "half_away"])
def test_w8a8_matches_integer_reference_bit_for_bit(rounding):
    q, scale, x = _case(3, x_scale=2.0)
    s_x = np.float16(2.0 ** -4)
    x[:4, 0] = np.array([2.5, -2.5, 0.5, 1.5], np.float16) * s_x  # exact ties
    x[4:6, 1] = [400.0, -400.0]  # saturates at 127 and -128
    profile = STRICT.replace(quantize_rounding=rounding)
    ql = QLinear(q, scale.astype(np.float32), act_scale=float(s_x))
    art, got = _run(ql, x.astype(np.float32), profile)
    want = ref_w8a8(q, scale, x, s_x, away=rounding == "half_away")
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert "quantize(" in art.mil_text and "dequantize(" in art.mil_text


def test_w8a8_rounding_modes_differ_on_ties():
    q = np.eye(O, C, dtype=np.int8)  # y[o] = q_x[o] · s_x
    x = np.zeros((C, S), np.float16)
    x[0, :] = 2.5 * 0.25
    ql = QLinear(q, np.ones(O, np.float32), act_scale=0.25)
    even = _run(ql, x.astype(np.float32), STRICT)[1][0, 0]
    away = _run(ql, x.astype(np.float32), STRICT.replace(quantize_rounding="half_away"))[1][0, 0]
    assert (even, away) == (0.5, 0.75)


def test_w8a8_int32_sum_is_not_limited():
    q = np.full((O, C), 127, np.int8)
    x = np.full((C, S), 127 * 0.5, np.float16)  # q_x = 127: Σ = 127·127·96 = 1,548,384 in int32
    ql = QLinear(q, np.full(O, 2.0 ** -12, np.float32), act_scale=0.5)
    _, got = _run(ql, x.astype(np.float32))
    np.testing.assert_array_equal(_bits(got), _bits(np.full((O, S), 1548384 * 0.5 * 2.0 ** -12)))


def test_int8_kernels_carry_int8_blobs():
    q, scale, x = _case(4)
    art, _ = _run(QLinear(q, scale.astype(np.float32), shift=2.0), x.astype(np.float32))
    dtypes = {c.dtype for blob in art.weights.values() for c in blob_chunks(blob)}
    assert "int8" in dtypes
    assert "constexpr_affine_dequantize" in art.mil_text
    assert "tensor<int8, [40, 96, 1, 1]>(BLOBFILE" in art.mil_text
