"""A QLinear as MIL: the form the references run on the chip.

    W = constexpr_affine_dequantize(quantized_data = int8 BLOBFILE [out, in, 1, 1],
                                    scale = fp16 [out], zero_point = int8(0), axis = 0)
    x' = x · gain / shift                               (the norm gain, quant/fold.py; W8 shift)
    W8:    y = conv(x', W)
    W8A8:  y = conv(dequantize(quantize(x', s), s), W)  (+ conv(conv(x', select), W_keep))

Why constexpr_affine_dequantize: it is the form maderix's W8A8 benchmark compiles and runs on
M4 (maderix-ane-facts §10.3, 1.88x over fp16) and that our doctor probe `op.constexpr_affine_
dequantize` checks; the weights stay int8 in the BLOBFILE (dtype code 4) and the compiler
folds the scale in when the program is compiled. The activations' quantize/dequantize pair
around the conv is the same benchmark's pattern; the cost model counts a conv fed by a
dequantize with constexpr weights as int8 work (compiler/passes/cost.py).

The outlier channels of a W8A8 input (`QLinear.keep`) are gathered by a 1x1 conv whose
weights select them (one 1.0 per row: each sum is one input value, exact) and multiplied by
their fp16 weight columns; k is a few channels, so the side product costs k/in of the main one.
"""

from __future__ import annotations

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Value
from .core import QLinear


def int8_weight(b: GraphBuilder, ql: QLinear, name: str) -> Value:
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
    xs = x
    if ql.act_scale is not None:
        s = np.float16(ql.act_scale)
        xs = b.dequantize(b.quantize(x, s, name=f"{n}_xq"), s, name=f"{n}_xdq")
    y = b.conv(xs, w, name=n if ql.keep_w is None and bias is None else f"{n}_conv")
    if ql.keep_w is not None:
        sel = np.zeros((len(ql.keep), ql.q.shape[1], 1, 1), np.float32)
        sel[np.arange(len(ql.keep)), ql.keep] = 1.0  # [k, in, 1, 1]: row r picks channel keep[r]
        picked = b.conv(x, sel, name=f"{n}_pick")  # [1, k, 1, S]
        side = b.conv(picked, ql.keep_w, name=f"{n}_keep")  # [1, out, 1, S] in fp16
        y = b.add(y, side, name=n if bias is None else f"{n}_sum")
    if bias is not None:
        y = b.add(y, b.weight(f"{n}_bias", np.asarray(bias).reshape(1, -1, 1, 1), x.dtype), name=n)
    return y
