"""INT8 in the device kernels: `QLinear`, a kernel's int8 linear, written as MIL in the form the
references run on the chip, and the int8 layer a `QuantPlan` (models/quantized.py) gives.

    W = constexpr_affine_dequantize(quantized_data = int8 BLOBFILE [out, in, 1, 1],
                                    scale = fp16 [out], zero_point = int8(0), axis = 0)
    x' = x · gain / shift                               (the norm gain, `unfolded_params`; W8 shift)
    W8:    y = conv(x', W)
    W8A8:  y = conv(dequantize(quantize(x', s), s), W)  (+ conv(conv(x', select), W_keep))
           or, in two products: a = dequantize(quantize(x', f), f), r = x' − a,
           y = conv(a, W) + conv(dequantize(quantize(r, s), s), W)  (+ the same side product)

W4 (`plan_layer_w4`): W = constexpr_blockwise_shift_scale(data = uint4 BLOBFILE [out, in, 1, 1],
scale = fp16 [out, in/B, 1, 1], offset = fp16 or uint4 [out, in/B, 1, 1]) of the folder's blocks
(models/quantized.py), then y = conv(x · gain, W) in fp16 like any fp16 conv: no shift, the
accumulator sums the dense weight's products.
LUT4/LUT6 (the same path): W = constexpr_lut_to_dense(indices = uint4/uint6 BLOBFILE [out, in, 1, 1],
lut = fp16 [out/G, in/B, 1, 1, 2^bits, 1]) of the folder's tables. A row fold goes into the tables
of a group whose G rows share its factor (always, for the attention and stream scales: one factor
a linear, and a group never spans two linears); any other row's factor would scale the conv's
output row (`LutQuant.out_scale`), a multiply the folds we have never need.

Why constexpr_affine_dequantize: it is the form maderix's W8A8 benchmark compiles and runs on
M4 (maderix-ane-facts §10.3, 1.88x over fp16) and that our doctor probe `op.constexpr_affine_
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

Norm affines and int8 (`unfolded_params`): `kernels/layers.layer_params` folds each norm's gain into the linears that read it,
W·(g ⊙ n) = (W·diag g)·n. That multiplies weight *columns*, so an int8 matrix would stop being
int8 times a row scale, and quantizing the folded matrix instead costs accuracy: on SmolLM2-135M
(256 held-out tokens of prose, CPU reference) int8 rows of the folded matrices raise perplexity
1.6 %, int8 rows of the HF matrices 0.7 %, since the gains (0.0003 to 0.6) spread each row's
columns over a wider range. So an int8 layer is built with unit gains, and each gain is applied
to the linear's input in the kernel (`QLinear.in_gain`, one mul that also carries the W8 shift).
The folds that scale whole rows (attention scale, residual stream scale) stay: requantizing a
row scaled by a power of two gives back the same int8 row (models/quantized.py).

LayerNorm's shift (GPT-2) stays folded: W·(g ⊙ n + s) + b = W·(g ⊙ n) + (W·s + b) moves it into
the bias, which is fp16 anyway. So the tensor an int8 linear of GPT-2 quantizes is g ⊙ n, the
CPU model's input to it minus s: calibration measures that (`norm_shifts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Value
from ..mil.blob import blob_backed
from ..models.quantized import BlockQuant, InputQuant, LutQuant, QuantPlan, quantize_rows


@dataclass(frozen=True)
class QLinear:
    """One kernel linear in int8, `[out, in]`, as `quant_linear` emits it.

    W8 (act_scale None): the conv sums q·x in the fp16 accumulator before the row scale
    (peer-facts §4.9), so x is first divided by `shift`, a power of two that keeps that sum
    under the 32768 limit (strict §2.9), and the row scale carries it back: exact both ways.
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


def kernel_layer(p: dict, inputs: dict[str, InputQuant], gains: dict[str, np.ndarray]) -> dict:
    """`layer_params` output {name: (W, b)} (built with unit norm gains) -> the same with QLinear
    for every name in `inputs` (the kernel's linears: qkv, o, gate, up, down), each carrying
    the gain its input needs; Qwen3's q/k norms and the rest pass through."""
    return {k: (qlinear(w, inputs[k], gains.get(k)), b) if k in inputs else (w, b) for k, (w, b) in p.items()}


def unfolded_params(shape, layer: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """(`layer_params` with unit gains on the norms the linears read, {kernel linear: the gain its
    input needs}). A gain is `gain_offset` + w (Gemma stores w and applies 1 + w), so the unit gain
    is w = 1 - offset: ones would give Gemma a gain of 2. Only those norms: the others are
    elementwise in the graph, not folded into a linear (Gemma's post-norms, whose gains carry the
    stream scale as `layer_params` makes them; the q/k norms)."""
    from .layers import layer_params  # noqa: PLC0415 - layers imports this module

    f, unit, gains = shape.family, dict(layer), {}
    for key in f.slot_roles:
        norm = f.reads_norm(key)
        if norm is not None:
            gains[key] = np.asarray(f.affine(layer, norm)[0], np.float32)
            name = f.modules[norm] + ".weight"
            unit[name] = np.full_like(layer[name], 1.0 - f.gain_offset)  # exact: 1 or 0
    return layer_params(shape, unit), gains


def plan_layer(plan: QuantPlan, i: int, shape, layer: dict[str, np.ndarray]) -> dict:
    """Layer i's kernel params (`layer_params` form, HF names inside the layer in `layer`)
    with its linears as QLinear and the norm gains on their inputs."""
    if plan.blocks:  # W4, LUT
        return plan_layer_w4(plan, i, shape, layer)
    f, inputs, per = shape.family, plan.layer(i), {}
    for key, roles in f.slot_roles.items():  # kernel linear -> the HF linears in its rows (q, k, v)
        parts = [inputs[f.modules[r]] for r in roles]
        shift = max(p.shift for p in parts)  # one conv: one shift
        per[key] = InputQuant(shift, parts[0].act_scale, parts[0].keep, parts[0].fine)  # one input: one set of scales
    p, gains = unfolded_params(shape, layer)
    return kernel_layer(p, per, gains)


def plan_layer_w4(plan: QuantPlan, i: int, shape, layer: dict[str, np.ndarray]) -> dict:
    """W4: layer i's kernel params with each linear held as the folder's 4-bit blocks (q, k and
    v stacked), the norm gains on the inputs as for int8 (`unfolded_params`). The folds that
    scale whole rows (q's attention scale, the stream scale of o and down) go into the blocks'
    scales: `layer_params` made W = diag(f)·W_hf, and f is read off the two (`row_factors`);
    the data and offsets are the folder's own, bit for bit."""
    f, blocks = shape.family, plan.layer_blocks(i)
    p, gains = unfolded_params(shape, layer)
    out = dict(p)
    for key, roles in f.slot_roles.items():
        parts = [blocks[f.modules[r]] for r in roles]
        bq = type(parts[0]).stack(parts)
        w, bias = p[key]
        scaled = bq.rows_scaled(row_factors(np.asarray(w, np.float32), bq.dense(), key))
        scale = scaled.out_scale if isinstance(scaled, LutQuant) else scaled.scale  # LUT: None, or per row
        out[key] = (QLinear(scaled, scale, in_gain=gains.get(key)), bias)
    return out


def row_factors(folded: np.ndarray, plain: np.ndarray, key: str) -> np.ndarray:
    """f with folded ≈ diag(f)·plain, from each row's largest element (zero rows: 1). Checked:
    a fold that is not a row scaling (a column one left in) is a bug, not a rounding."""
    j = np.abs(plain).argmax(axis=1)
    rows = np.arange(plain.shape[0])
    top = plain[rows, j].astype(np.float64)
    fac = np.where(top != 0, folded[rows, j] / np.where(top != 0, top, 1.0), 1.0)
    if not np.allclose(folded, plain * fac[:, None], rtol=1e-5, atol=1e-30):
        raise AssertionError(f"W4 linear {key}: the kernel's folds are not a scaling of whole rows")
    return fac


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
