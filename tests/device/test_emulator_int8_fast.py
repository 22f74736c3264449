"""The W8 fast path (device/emulator/int8.py: `matvec_int8`, `times_int8`, `W8Conv.column`, bound
in emulator.steps) against the general int8 path (`general_conv2d_int`: float64 GEMMs over the
widened weights), bit for bit, on random fp16 inputs large enough that some sums reach the
accumulator's 32768 limit; and a plan evaluated bound (decode) and unbound gives the same."""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.device.emulator.accum import _to_fp16, saturate
from anelm.device.emulator.int8 import Int8Weight, W8Conv, general_conv2d_int, int8_times, int_conv
from anelm.ir.builder import GraphBuilder
from anelm.kernels.qlinear import QLinear, quant_linear
from anelm.runtime.kernel import Kernel

P = {"groups": 1, "pad_type": "valid", "strides": [1, 1], "dilations": [1, 1], "pad": [0, 0, 0, 0]}


def _weight(rng, oc, c) -> Int8Weight:
    q = rng.integers(-128, 128, (oc, c, 1, 1)).astype(np.int8)
    scale = (rng.uniform(0.5, 2.0, oc) / 64).astype(np.float16).astype(np.float64).reshape(1, oc, 1, 1)
    return Int8Weight(q, np.zeros((oc, 1, 1, 1)), scale)


def _x(rng, c, t, big: float) -> np.ndarray:
    return (rng.standard_normal((1, c, 1, t)) * big).astype(np.float16).astype(np.float32)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float16).view(np.uint16)


@pytest.mark.parametrize("oc,c", [(40, 96), (7, 33), (130, 576), (64, 1536)])
@pytest.mark.parametrize("t", [1, 3, 16, 17, 40])
def test_fast_sums_equal_general(oc, c, t):
    rng = np.random.default_rng(oc * 1000 + c + t)
    w = _weight(rng, oc, c)
    for big in (0.01, 1.0, 30.0, 3000.0):  # the largest: many sums past 32768, some tiny values
        x = _x(rng, c, t, big)
        fast = int8_times(w.ints.reshape(oc, c), x.reshape(1, c, t)).reshape(1, oc, 1, t)
        assert np.array_equal(fast, general_conv2d_int(x, w, P))
        assert np.array_equal(int_conv(x, w, P), fast)


@pytest.mark.parametrize("oc,c", [(40, 96), (576, 576)])
def test_column_equals_general_with_limit(oc, c):
    rng = np.random.default_rng(c)
    w = _weight(rng, oc, c)
    conv = W8Conv(w, 32768.0, "fp32")
    hit = 0
    for big in (0.1, 10.0, 300.0, 3000.0):
        x = _x(rng, c, 1, big)
        ref = saturate(general_conv2d_int(x, w, P), 32768.0)
        hit += int(np.isinf(ref).sum())
        want = _to_fp16(ref * w.scale)
        assert np.array_equal(_bits(conv.column(x)), _bits(want))
        assert np.array_equal(_bits(conv({"x": x}, P)[0]), _bits(want))
    assert hit > 0  # the limit was met


def test_no_fast_path_for_zero_points_or_q1516():
    rng = np.random.default_rng(1)
    w = _weight(rng, 8, 16)
    assert W8Conv(w, 32768.0, "q15.16").column is None
    shifted = Int8Weight(w.ints, np.ones((8, 1, 1, 1)), w.scale)
    assert W8Conv(shifted, 32768.0, "fp32").column is None
    x = _x(rng, 16, 5, 1.0)
    assert np.array_equal(int_conv(x, shifted, P), general_conv2d_int(x, shifted, P))


def test_decode_column_bound_equals_plan_run(monkeypatch):
    """A W8 linear's program, its column evaluated bound (decode) and through Plan.run, and
    the 16-column evaluation's first column: one result, bit for bit."""
    calls = []
    column = W8Conv._column
    monkeypatch.setattr(W8Conv, "_column", lambda self, v: calls.append(1) or column(self, v))
    rng = np.random.default_rng(5)
    c, oc = 96, 40
    q = rng.integers(-127, 128, (oc, c)).astype(np.int8)
    ql = QLinear(q, rng.uniform(0.01, 0.02, oc).astype(np.float32))
    b = GraphBuilder("w8col")
    xin = b.input("x", [1, c, 1, 16])
    b.output("y", quant_linear(b, xin, ql, None, "lin"))
    art = compile_graph(b.build(), STRICT)
    x = (rng.standard_normal((1, c, 1, 16)) * 400).astype(np.float16).astype(np.float32)
    wide = Kernel(art, Emulator(STRICT))(x=x)["y"]
    col = Kernel(art, Emulator(STRICT), read_columns=1)
    one = col(x=x)["y"]
    assert np.array_equal(_bits(one[..., 0]), _bits(wide[..., 0]))
    assert calls  # the decode evaluation took the bound column path
    assert np.isinf(wide).any()  # some sums met the limit
