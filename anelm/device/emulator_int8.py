"""The emulator's int8 arithmetic (CONTRACTS §10, peer-facts §4.9), as plan rewrites.

A `conv` whose weight is `constexpr_affine_dequantize` of int8 data, with a per-output-channel
(axis 0) or scalar scale, does not run as a conv on the dequantized fp16 weights. The weights
stay int8 in the plan (one byte an element, as on the chip) and:

* **W8** (x fp16): acc[o] = Σ_k (q[o,k] − zp[o]) · x[k], formed exactly; the accumulator of
  strict §2.9 acts on that *unscaled* sum (fp32: |acc| >= limit is ±inf; q15.16: the fixed-point
  register of emulator_accum on the integer weights); then y = acc · scale[o], rounded once to
  fp16. "Exactly": every q·x is a multiple of 2^-24 (x is fp16), so float64 holds every partial
  sum without error while Σ|q·x| < 2^29, which any sum below the limit's 32768 by a margin of
  2^14 satisfies; so the summation order does not matter and the numpy reference can match it
  bit for bit.
* **W8A8** (x = dequantize(q_x, s_x) with q_x int8 from `quantize`, scalar scale and zero
  point): acc = Σ (q[o,k] − zp[o])(q_x[k] − zp_x), an integer (int32 on the chip: no 32768
  limit; |acc| < 2^31 for any contraction under 131,072), then y = acc · s_x · scale[o]. The
  product of an integer under 2^31 and two fp16 scales (11 significant bits each) is exact in
  float64, so y is rounded to fp16 once. The conv reads q_x itself; the dequantize, when
  nothing else reads it, is dropped.

A bias (profiles that allow one) is added after the row scale: no source says where an int8
conv's bias enters. `quantize` saturates at the int8 range, with the profile's rounding of
ties (`quantize_rounding`): half to even by default, as MIL's reference implementation (and
coremltools' value inference) rounds; the M6 study's "half away from zero" is reported for the
fp16 outputs of the accumulator, not for quantize, so it is kept as the switch for `anelm
doctor` to settle rather than extrapolated. Ties need x/s to be exactly k + 1/2, which int8
activations of real text rarely meet: the choice moves perplexity by nothing we could measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

from ..ir.ops_common import along_axis
from ..ir.ops_linear import conv, conv_taps
from ..ir.ops_quant import quantize_values
from .emulator_accum import _fixed_conv2d, _to_fp16, saturate

_ROWS = 256  # rows of int8 weights widened to float64 at once by the GEMM path (3 MiB at K=1536)


@dataclass(frozen=True)
class Int8Weight:
    ints: np.ndarray  # int8 data as stored
    zp: np.ndarray  # float64 [OC, 1, 1, 1] or a scalar (0 when absent)
    scale: np.ndarray  # float64 [1, OC, 1, 1] or a scalar: multiplies the conv's result


@dataclass
class Int8State:
    """What the plan builder remembers between statements."""

    weights: dict[str, Int8Weight] = field(default_factory=dict)  # constexpr result -> int8 weight
    quantized: dict[str, tuple[str, float, float]] = field(default_factory=dict)  # dequantize result ->
    # (its int8 input, scale, zero point)
    rewired: set[str] = field(default_factory=set)  # dequantize results the int8 convs bypass


def note(state: Int8State, op: str, tensors: dict, consts: dict, params: dict, result: str) -> None:
    """Remember an int8 weight (constexpr_affine_dequantize) or an int8 activation (dequantize)."""
    get = lambda k: None if tensors.get(k) is None else consts.get(tensors[k])  # noqa: E731
    if op == "constexpr_affine_dequantize":
        q, scale, zp = get("quantized_data"), get("scale"), get("zero_point")
        zp = np.zeros(()) if zp is None else np.asarray(zp, np.float64)
        vector = np.size(scale) > 1 or zp.size > 1
        if q is None or q.dtype != np.int8 or q.ndim != 4 or (vector and params.get("axis") != 0):
            return  # not a per-output-channel int8 conv weight: the fp16 fold stands
        state.weights[result] = Int8Weight(q, along_axis(zp, 0, 4).astype(np.float64),
                                           along_axis(np.asarray(scale, np.float64), 1, 4))
    elif op == "dequantize":
        scale, zp = get("scale"), get("zero_point")
        if scale is not None and np.ndim(scale) == 0 and (tensors.get("zero_point") is None or zp is not None):
            state.quantized[result] = (tensors["input"], float(scale), 0.0 if zp is None else float(zp))


def rewrite(state: Int8State, op: str, tensors: list, params: dict, rounding: str, limit, accumulator: str):
    """(compute, tensors) for an int8 step, or None to keep the op table's."""
    if op == "quantize":
        return (lambda x, p: quantize_values(x, p, rounding)), tensors
    if op != "conv":
        return None
    keys = dict(tensors)
    w = state.weights.get(keys["weight"])
    if w is None or isinstance(keys["x"], list):
        return None
    rest = [(k, v) for k, v in tensors if k not in ("x", "weight")]  # the bias, if any
    src = state.quantized.get(keys["x"])
    if src is not None:  # W8A8: the conv reads the int8 activations
        state.rewired.add(keys["x"])
        q_in, s_x, zp_x = src
        return _w8a8(w, s_x, zp_x), [("x", q_in)] + rest
    return _w8(w, limit, accumulator), [("x", keys["x"])] + rest


def _w8(w: Int8Weight, limit, accumulator: str):
    cap = np.inf if limit is None else float(limit)

    def compute(x, p):
        v = x["x"]
        if accumulator == "q15.16":
            ints = w.ints.astype(np.float64) - w.zp
            acc = conv({"x": v, "weight": ints}, p, conv2d=lambda a, k, b, q: _fixed_conv2d(a, k, None, q, cap))[0]
        else:
            acc = int_conv(v, w, p)
            acc = acc if limit is None else saturate(acc, cap)
        return [_finish(acc * w.scale, x.get("bias"))]
    return compute


def _w8a8(w: Int8Weight, s_x: float, zp_x: float):
    def compute(x, p):
        qx = x["x"].astype(np.float64) - zp_x  # exact small integers
        return [_finish(int_conv(qx, w, p) * np.float64(s_x) * w.scale, x.get("bias"))]
    return compute


def _finish(y: np.ndarray, bias) -> np.ndarray:
    if bias is not None:
        y = y + np.asarray(bias, np.float64).reshape(1, -1, *([1] * (y.ndim - 2)))
    return _to_fp16(y)


def int_conv(v: np.ndarray, w: Int8Weight, p: dict) -> np.ndarray:
    """Σ (q − zp)·v of a conv with int8 weights, in float64 (exact: see the module doc)."""
    return conv({"x": v, "weight": w}, p, conv2d=_conv2d_int)[0]


def _conv2d_int(v, w: Int8Weight, bias, p) -> np.ndarray:
    n, c, h, wd = v.shape
    oc = w.ints.shape[0]
    plain = not np.any(w.zp)
    if w.ints.shape[2:] == (1, 1) and int(p["groups"]) == 1 and p["pad_type"] == "valid" \
            and all(int(s) == 1 for s in (p["strides"] or [1, 1])) and plain:
        x = np.ascontiguousarray(v.reshape(n, c, h * wd), np.float64)  # [N, C, HW]
        q = w.ints.reshape(oc, c)
        if h * wd <= 4:  # decode: stream the int8 rows once, no widened copy
            out = np.stack([_matvec_cols(q, x[i]) for i in range(n)])
        else:
            out = np.empty((n, oc, h * wd))
            for r in range(0, oc, _ROWS):  # widen a block of rows, then one float64 GEMM
                out[:, r:r + _ROWS] = np.matmul(q[r:r + _ROWS].astype(np.float64), x)
        return out.reshape(n, oc, h, wd)
    ints = w.ints.astype(np.float64) - w.zp
    (oh, ow), taps = conv_taps(v.astype(np.float64), ints.shape, p)
    g = int(p["groups"])
    out = np.zeros((n, g, oc // g, oh * ow))
    for w_tap, x_tap in taps:
        out += np.matmul(w_tap(ints), x_tap)
    return out.reshape(n, oc, oh, ow)


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _matvec_cols(q, x):  # pragma: no cover - compiled
    # reassociation is safe: every partial sum is exact (module doc), so any order gives the same
    oc, c = q.shape
    s = x.shape[1]
    out = np.zeros((oc, s))
    for j in range(s):
        for o in range(oc):
            acc = 0.0
            for k in range(c):
                acc += q[o, k] * x[k, j]
            out[o, j] = acc
    return out


def drop_bypassed(plan, state: Int8State) -> None:
    """Remove the dequantize steps every int8 conv now bypasses, unless something else reads them."""
    read = set(plan.outputs)
    for st in plan.steps:
        for _, key in st.tensors:
            read.update(key if isinstance(key, list) else [key])
    plan.steps = [st for st in plan.steps if not (st.op == "dequantize" and st.outs[0][0] in state.rewired
                                                  and st.outs[0][0] not in read)]
