"""A kernel's quantized linear: `QLinear` (int8, W4 blocks or LUT tables), written as MIL in the
form the references run on the chip. `kernels/int8.py` builds a layer's QLinears from a plan.

    W = constexpr_affine_dequantize(quantized_data = int8 BLOBFILE [out, in, 1, 1],
                                    scale = fp16 [out], zero_point = int8(0), axis = 0)
    x' = x · gain / shift                               (the norm gain, `unfolded_params`; W8 shift)
    W8:    y = conv(x', W)
    W8A8:  y = conv(dequantize(quantize(x', s), s), W)  (+ conv(conv(x', select), W_keep))
           or, in two products: a = dequantize(quantize(x', f), f), r = x' − a,
           y = conv(a, W) + conv(dequantize(quantize(r, s), s), W)  (+ the same side product)

W4 (`int8.plan_layer_w4`): W = constexpr_blockwise_shift_scale(data = uint4 BLOBFILE [out, in, 1, 1],
scale = fp16 [out, in/B, 1, 1], offset = fp16 or uint4 [out, in/B, 1, 1]) of the folder's blocks
(models/formats/quantized.py), then y = conv(x · gain, W) in fp16 like any fp16 conv: no shift, the
accumulator sums the dense weight's products.
LUT4/LUT6 (the same path): W = constexpr_lut_to_dense(indices = uint4/uint6 BLOBFILE [out, in, 1, 1],
lut = fp16 [out/G, in/B, 1, 1, 2^bits, 1]) of the folder's tables. A row fold goes into the tables
of a group whose G rows share its factor (always, for the attention and stream scales: one factor
a linear, and a group never spans two linears); any other row's factor would scale the conv's
output row (`LutQuant.out_scale`), a multiply the folds we have never need.

Why constexpr_affine_dequantize: it is the form maderix's W8A8 benchmark compiles and runs on
M4 (the maderix README: 1.88x over fp16) and that our doctor probe `op.constexpr_affine_
dequantize` checks; the weights stay int8 in the BLOBFILE (dtype code 4) and the compiler
folds the scale in when the program is compiled. The activations' quantize/dequantize pair
around the conv is the same benchmark's pattern; the cost model counts a conv fed by a
dequantize with constexpr weights as int8 work (compiler/passes/cost.py).

Two products (`QLinear.act_scale` = (f, s), quant/w8a8.py): the fine scale f holds the input's
bulk and saturates on its few large values; r, what that left (under f/2 for the bulk, rounding
to 0 at s), carries those at the coarse scale s. Both convs are int8 × int8 on the one int8
constexpr, each with one static scale, as the chip's W8A8 runs; the emulator's int8 path takes
each conv fed by a dequantize as it takes one.

The outlier channels of a W8A8 input (`QLinear.keep`) are gathered by a 1x1 conv whose
weights select them (one 1.0 per row: each sum is one input value, exact) and multiplied by
their fp16 weight columns; k is a few channels, so the side product costs k/in of the main one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Value
from ..mil.blob import blob_backed
from ..models.formats.quantized import BlockQuant, InputQuant, LutQuant, quantize_rows


@dataclass(frozen=True)
class QLinear:
    """One kernel linear in int8, `[out, in]`, as `quant_linear` emits it.

    W8 (act_scale None): the conv sums q·x in the fp16 accumulator before the row scale
    (docs/chip-profiles.md), so x is first divided by `shift`, a power of two that keeps that sum
    under the accumulator limit of 32768, and the row scale carries it back: exact both ways.
    W8A8: x is quantized to int8 at the static per-tensor `act_scale` (a pair: in two products,
    module doc); the input channels in `keep` (activation outliers that one int8 scale cannot
    hold with the rest) are left out of int8: their weight columns are zero in q, and `keep_w`
    [out, len(keep)] multiplies them in fp16 beside the int8 product.
    """

    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # float32 [out]
    shift: float = 1.0
    # (fine, coarse): two products (module doc); one field, so the program store's digest of
    # QLinear's fields (generate/program_store._QFIELDS) covers both scales
    act_scale: float | tuple[float, float] | None = None
    keep: np.ndarray | None = None  # int [k] input channels in fp16
    keep_w: np.ndarray | None = None  # float32 [out, k]
    in_gain: np.ndarray | None = None  # float32 [in]: the norm gain on the input (`unfolded_params`)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


def qlinear(w: np.ndarray, iq: InputQuant, gain: np.ndarray | None = None) -> QLinear:
    """The int8 form of a float [out, in] linear for the input decided by `iq`."""
    keep_w = None
    if iq.keep is not None and len(iq.keep):
        keep_w = np.ascontiguousarray(w[:, iq.keep], np.float32)
        w = w.copy()
        w[:, iq.keep] = 0.0  # those channels go through the fp16 side product
    q, scale = quantize_rows(w)
    q = blob_backed(q, "int8")  # its BLOBFILE's payload: the programs' blob is this memory (program_store)
    keep = None if keep_w is None else np.asarray(iq.keep, np.int64)
    act = iq.act_scale if iq.fine is None else (iq.fine, iq.act_scale)
    return QLinear(q, scale, iq.shift, act, keep, keep_w, gain)


def int8_weight(b: GraphBuilder, ql: QLinear, name: str) -> Value:
    if isinstance(ql.q, LutQuant):  # LUT: the tables' entries picked when the program is compiled
        lq = ql.q
        return b.constexpr_lut_to_dense(lq.indices.reshape(*lq.shape, 1, 1), f"uint{lq.bits}",
                                        lq.lut.reshape(*lq.lut.shape[:2], 1, 1, -1, 1), name=f"{name}_lut")
    if isinstance(ql.q, BlockQuant):  # W4: the 4-bit blocks made dense when the program is compiled
        bq, shape = ql.q, (*ql.q.shape, 1, 1)
        nb = (bq.shape[0], bq.scale.shape[1], 1, 1)
        off = bq.offset.reshape(nb)
        return b.constexpr_blockwise_shift_scale(bq.data.reshape(shape), "uint4", bq.scale.reshape(nb), off,
                                                 name=f"{name}_w4")
    q = ql.q.reshape(*ql.q.shape, 1, 1)  # [out, in] -> [out, in, 1, 1], the 1x1 conv weight
    return b.constexpr_affine_dequantize(q, (ql.scale * np.float32(ql.shift)).astype(np.float16),
                                         0, axis=0, name=f"{name}_w8")


def quant_linear(b: GraphBuilder, x: Value, ql: QLinear, bias=None, name: str = "linear") -> Value:
    """y = W x (+ bias) for x `[1, in, 1, S]` with W held as int8 (module doc)."""
    n = b.graph.peek_name(name)
    w = int8_weight(b, ql, n)
    if ql.in_gain is not None:  # the norm gain, with the W8 shift in the same multiply
        x = b.mul(x, b.weight(f"{n}_gain", (ql.in_gain / np.float32(ql.shift)).reshape(1, -1, 1, 1), x.dtype),
                  name=f"{n}_in")
    elif ql.shift != 1.0:
        x = b.mul(x, 1.0 / ql.shift, name=f"{n}_shift")
    xs, rest = [x], x
    if ql.act_scale is not None:  # each product's int8 input; the next reads what it left over
        xs = []
        for j, a in enumerate(ql.act_scale if isinstance(ql.act_scale, tuple) else (ql.act_scale,)):
            s, tag = np.float16(a), "" if j == 0 else str(j)
            if xs:
                rest = b.sub(rest, xs[-1], name=f"{n}_xr{tag}")
            xs.append(b.dequantize(b.quantize(rest, s, name=f"{n}_xq{tag}"), s, name=f"{n}_xdq{tag}"))
    lut_rows = isinstance(ql.q, LutQuant) and ql.scale is not None  # row factors no table took
    last = ql.keep_w is None and bias is None and not lut_rows and len(xs) == 1
    y = b.conv(xs[0], w, name=n if last else f"{n}_conv")
    for j, xj in enumerate(xs[1:], 1):  # the same int8 weight: one constexpr, two int8 products
        done = ql.keep_w is None and bias is None and not lut_rows and j == len(xs) - 1
        y = b.add(y, b.conv(xj, w, name=f"{n}_conv{j}"), name=n if done else f"{n}_acc{j}")
    if lut_rows:
        rows = b.weight(f"{n}_rows", ql.scale.reshape(1, -1, 1, 1), x.dtype)
        y = b.mul(y, rows, name=n if bias is None else f"{n}_r")
    if ql.keep_w is not None:
        sel = np.zeros((len(ql.keep), ql.q.shape[1], 1, 1), np.float32)
        sel[np.arange(len(ql.keep)), ql.keep] = 1.0  # [k, in, 1, 1]: row r picks channel keep[r]
        picked = b.conv(x, sel, name=f"{n}_pick")  # [1, k, 1, S]
        side = b.conv(picked, ql.keep_w, name=f"{n}_keep")  # [1, out, 1, S] in fp16
        y = b.add(y, side, name=n if bias is None else f"{n}_sum")
    if bias is not None:
        y = b.add(y, b.weight(f"{n}_bias", np.asarray(bias).reshape(1, -1, 1, 1), x.dtype), name=n)
    return y
