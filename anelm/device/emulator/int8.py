"""The emulator's int8 arithmetic (docs/quantization.md), as plan rewrites.

A `conv` whose weight is `constexpr_affine_dequantize` of int8 data, with a per-output-channel
(axis 0) or scalar scale, does not run as a conv on the dequantized fp16 weights. The weights
stay int8 in the plan (one byte an element, as on the chip) and:

* **W8** (x fp16): acc[o] = Σ_k (q[o,k] − zp[o]) · x[k], formed exactly; the accumulator
  limit acts on that *unscaled* sum, as pmetal found (fp32: |acc| >= limit is ±inf; q15.16: the
  fixed-point register of emulator.accum on the integer weights); then y = acc · scale[o],
  rounded once to fp16. "Exactly": every q·x is a multiple of 2^-24 (x is fp16), so float64
  holds every partial sum without error while Σ|q·x| < 2^29, which any sum below the limit's
  32768 by a margin of 2^14 satisfies; so the summation order does not matter and the numpy
  reference can match it bit for bit.
* **W8A8** (x = dequantize(q_x, s_x) with q_x int8 from `quantize`, scalar scale and zero
  point): acc = Σ (q[o,k] − zp[o])(q_x[k] − zp_x), an integer (int32 on the chip: no 32768
  limit; |acc| < 2^31 for any contraction under 131,072), then y = acc · s_x · scale[o]. The
  product of an integer under 2^31 and two fp16 scales (11 significant bits each) is exact in
  float64, so y is rounded to fp16 once. The conv reads q_x itself; the dequantize, when
  nothing else reads it, is dropped.

Speed (W8, zero points 0, 1x1, fp32 accumulator; the sums being exact, any order gives the
same bits): one column streams the int8 rows through `matvec_int8` (bound as `W8Conv.column` in
emulator.steps for decode); more columns through `times_int8`'s float64 register tiles over rows
widened four at a time. SmolLM2-135M W8 on the emulator, warm: prefill 5.1 s -> 0.17 s, decode
16 -> 35 tokens/s (fp16: 88 ms, 37-42). A program's int8 weights fold to an empty stand-in: its
convs read the int8 data, and the fp16 matrix took 0.65 ms a matrix at every program load.

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
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...ir.ops_common import along_axis
from ...ir.ops_linear import conv, conv_taps
from ...ir.ops_quant import quantize_values
from .accum import _fixed_conv2d, _to_fp16, saturate

_L = 4  # float64 lanes of a vector register
_H = 4  # vector registers of x a tile's row multiplies
_COLS = _H * _L  # columns of a W8 register tile
_R = 4  # rows of a W8 register tile (times_int8)


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
    latest: str | None = None  # the int8 weight `note` has just remembered


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
        state.latest = result
    elif op == "dequantize":
        scale, zp = get("scale"), get("zero_point")
        if scale is not None and np.ndim(scale) == 0 and (tensors.get("zero_point") is None or zp is not None):
            state.quantized[result] = (tensors["input"], float(scale), 0.0 if zp is None else float(zp))


def rewrite(state: Int8State, op: str, tensors: list, params: dict, rounding: str, limit, accumulator: str):
    """(compute, tensors) for an int8 step, or None to keep the op table's."""
    if op == "quantize":
        return (lambda x, p: quantize_values(x, p, rounding)), tensors
    if op == "constexpr_affine_dequantize" and state.latest is not None:
        # an int8 weight: its convs read the int8 data, so the fp16 matrix the fold would make
        # (0.65 ms a matrix on SmolLM2, every program load) is an empty stand-in, which nothing
        # else reads (a step that did would fail on its shape, not compute with it)
        state.latest = None
        return (lambda x, p: [np.empty(0, np.float32)]), tensors
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
    return W8Conv(w, limit, accumulator), [("x", keys["x"])] + rest


class W8Conv:
    """A W8 conv's compute (module doc). `column`: a decode token's product, one column
    `[1, C, 1, 1]` in, the finished fp16 values out (the accumulator's limit, the row scale),
    without the op table's per-call work; None where the sums are not the fast path's (q15.16,
    zero points, a conv other than a plain 1x1)."""

    def __init__(self, w: Int8Weight, limit, accumulator: str):
        self.w, self.limit, self.accumulator = w, limit, accumulator
        self.cap = np.inf if limit is None else float(limit)
        fast = accumulator != "q15.16" and w.ints.shape[2:] == (1, 1) and not np.any(w.zp)
        self.rows = np.ascontiguousarray(w.ints.reshape(w.ints.shape[0], -1)) if fast else None
        self.column = self._column if fast else None

    def __call__(self, x, p):
        v, w = x["x"], self.w
        if self.accumulator == "q15.16":
            ints = w.ints.astype(np.float64) - w.zp
            acc = conv({"x": v, "weight": ints}, p, conv2d=lambda a, k, b, q: _fixed_conv2d(a, k, None, q, self.cap))[0]
        else:
            acc = int_conv(v, w, p)
            acc = acc if self.limit is None else saturate(acc, self.cap)
        return [_finish(acc * w.scale, x.get("bias"))]

    def _column(self, v: np.ndarray) -> np.ndarray:
        acc = np.empty(self.rows.shape[0])
        matvec_int8(self.rows, np.ascontiguousarray(v.reshape(-1), np.float64), acc)
        acc = acc.reshape(1, -1, 1, 1)
        acc = acc if self.limit is None else saturate(acc, self.cap)
        return _to_fp16(acc * self.w.scale)


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
    if w.ints.shape[2:] == (1, 1) and int(p["groups"]) == 1 and p["pad_type"] == "valid" \
            and all(int(s) == 1 for s in (p["strides"] or [1, 1])) and not np.any(w.zp):
        return int8_times(w.ints.reshape(oc, c), v.reshape(n, c, h * wd)).reshape(n, oc, h, wd)
    return general_conv2d_int(v, w, p)


def general_conv2d_int(v, w: Int8Weight, p) -> np.ndarray:
    """Σ (q − zp)·v over the conv's taps, float64 GEMMs on the widened weights (any conv)."""
    n, oc = v.shape[0], w.ints.shape[0]
    ints = w.ints.astype(np.float64) - w.zp
    (oh, ow), taps = conv_taps(v.astype(np.float64), ints.shape, p)
    g = int(p["groups"])
    out = np.zeros((n, g, oc // g, oh * ow))
    for w_tap, x_tap in taps:
        out += np.matmul(w_tap(ints), x_tap)
    return out.reshape(n, oc, oh, ow)


def int8_times(q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """q `[OC, C]` int8 times x `[N, C, T]`: the exact sums, float64 `[N, OC, T]`. One column:
    `matvec_int8` streams the int8 rows; more: register tiles (`times_int8`) over x padded with
    zero columns to a multiple of the tile's."""
    q = np.ascontiguousarray(q)
    n, c, t = x.shape
    out = np.empty((n, q.shape[0], t))
    if t == 1:
        for i in range(n):
            matvec_int8(q, np.ascontiguousarray(x[i, :, 0], np.float64), out[i].reshape(-1))
        return out
    wide = -(-t // _COLS) * _COLS
    xp = np.zeros((c, wide))
    part = out if wide == t else np.empty((n, q.shape[0], wide))
    for i in range(n):
        xp[:, :t] = x[i]
        times_int8(q, xp, part[i])
    return out if wide == t else np.ascontiguousarray(part[:, :, :t])


def drop_bypassed(plan, state: Int8State) -> None:
    """Remove the dequantize steps every int8 conv now bypasses, unless something else reads them."""
    read = set(plan.outputs)
    for st in plan.steps:
        for _, key in st.tensors:
            read.update(key if isinstance(key, list) else [key])
    plan.steps = [st for st in plan.steps if not (st.op == "dequantize" and st.outs[0][0] in state.rewired
                                                  and st.outs[0][0] not in read)]


# --------------------------------------------------------------------------- the W8 products
# Every q·x sum below is exact in float64 (module doc), so these kernels, whatever their order,
# give the sums the float64 GEMMs of `general_conv2d_int` give, bit for bit (tests/device/test_emulator_int8_fast.py).

@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def matvec_int8(q, x, out):  # pragma: no cover - compiled
    """out[o] = Σ_k q[o, k]·x[k]: q `[OC, C]` int8, x `[C]` and out `[OC]` float64, contiguous."""
    oc, c = q.shape
    for o in range(oc):
        acc = 0.0
        for k in range(c):
            acc += q[o, k] * x[k]
        out[o] = acc


@intrinsic
def _tile_4x8(typingctx, w, ldw, x, ldx, out, ldo, depth, ahead):
    """out[i·ldo + j] = Σ_{k < depth} w[i·ldw + k]·x[k·ldx + j] for i < 4, j < 8: addresses of
    float64 arrays, strides in elements; the 32 sums in eight 4-lane registers, one fused
    multiply-add a step (`emulator.matvec._tile_4x16` in float64); `ahead`: int8 rows to prefetch."""
    sig = types.void(types.uintp, types.intp, types.uintp, types.intp, types.uintp, types.intp, types.intp, types.uintp)

    def codegen(context, builder, sig, args):
        w, ldw, x, ldx, out, ldo, depth, ahead = args
        f64, i64, i32 = ir.DoubleType(), ir.IntType(64), ir.IntType(32)
        v4 = ir.VectorType(f64, _L)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v4, [v4, v4, v4]), f"llvm.fmuladd.v{_L}f64")
        i8p = ir.IntType(8).as_pointer()
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                  "llvm.prefetch.p0i8")

        def at(base, index, vector=False):
            addr = builder.add(base, builder.mul(index, ir.Constant(i64, 8)))
            return builder.inttoptr(addr, (v4 if vector else f64).as_pointer())

        acc = [cgutils.alloca_once_value(builder, ir.Constant(v4, [0.0] * _L)) for _ in range(_H * _R)]
        with cgutils.for_range(builder, depth) as loop:
            k = loop.index
            addr = builder.inttoptr(builder.add(ahead, builder.mul(k, ir.Constant(i64, _R))), i8p)
            builder.call(prefetch, [addr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            row = builder.mul(k, ldx)
            xs = [builder.load(at(x, builder.add(row, ir.Constant(i64, _L * h)), True), align=8) for h in range(_H)]
            for i in range(_R):
                wk = builder.load(at(w, builder.add(builder.mul(ir.Constant(i64, i), ldw), k)), align=8)
                lane0 = builder.insert_element(ir.Constant(v4, None), wk, ir.Constant(i32, 0))
                splat = builder.shuffle_vector(lane0, ir.Constant(v4, None), ir.Constant(ir.VectorType(i32, _L), [0] * _L))
                for h in range(_H):
                    builder.store(builder.call(fma, [splat, xs[h], builder.load(acc[_H * i + h])]), acc[_H * i + h])
        for i in range(_R):
            for h in range(_H):
                index = builder.add(builder.mul(ir.Constant(i64, i), ldo), ir.Constant(i64, _L * h))
                builder.store(builder.load(acc[_H * i + h]), at(out, index, True), align=8)
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(nogil=True, cache=True)
def times_int8(q, x, out):  # pragma: no cover - compiled
    """out = q·x: q `[OC, C]` int8, x `[C, T]` and out `[OC, T]` float64, C-contiguous, T a
    multiple of 8. Four rows at a time are widened to float64 (a scratch in L1/L2) and multiplied
    with each 8 columns of x in register tiles; a last partial block goes through a spare tile."""
    oc, c = q.shape
    t = x.shape[1]
    flat = q.reshape(oc * c)
    rows = np.empty(_R * c)
    spare = np.empty(_R * _COLS)
    for o in range(0, oc, _R):
        n = min(_R, oc - o)
        block = flat[o * c:(o + n) * c]  # a slice, so that LLVM vectorizes the widening (10x)
        for i in range(block.size):
            rows[i] = block[i]
        for i in range(n * c, _R * c):
            rows[i] = 0.0
        ahead = q.ctypes.data + (o + _R) * c  # the next block's rows (past the end: a dropped prefetch)
        for j in range(0, t, _COLS):
            if n == _R:
                _tile_4x8(rows.ctypes.data, c, x.ctypes.data + 8 * j, t, out.ctypes.data + 8 * (o * t + j), t, c, ahead)
            else:
                _tile_4x8(rows.ctypes.data, c, x.ctypes.data + 8 * j, t, spare.ctypes.data, _COLS, c, ahead)
                for i in range(n):
                    for jj in range(_COLS):
                        out[o + i, j + jj] = spare[i * _COLS + jj]
