"""The quantized layer a `QuantPlan` (models/formats/quantized.py) gives: each kernel linear as a
`qlinear.QLinear`, the norm gains on their inputs.

Norm affines and int8 (`unfolded_params`): `kernels/layers.layer_params` folds each norm's gain into the linears that read it,
W·(g ⊙ n) = (W·diag g)·n. That multiplies weight *columns*, so an int8 matrix would stop being
int8 times a row scale, and quantizing the folded matrix instead costs accuracy: on SmolLM2-135M
(256 held-out tokens of prose, CPU reference) int8 rows of the folded matrices raise perplexity
1.6 %, int8 rows of the HF matrices 0.7 %, since the gains (0.0003 to 0.6) spread each row's
columns over a wider range. So an int8 layer is built with unit gains, and each gain is applied
to the linear's input in the kernel (`QLinear.in_gain`, one mul that also carries the W8 shift).
The folds that scale whole rows (attention scale, residual stream scale) stay: requantizing a
row scaled by a power of two gives back the same int8 row (models/formats/quantized.py).

LayerNorm's shift (GPT-2) stays folded: W·(g ⊙ n + s) + b = W·(g ⊙ n) + (W·s + b) moves it into
the bias, which is fp16 anyway. So the tensor an int8 linear of GPT-2 quantizes is g ⊙ n, the
CPU model's input to it minus s: calibration measures that (`norm_shifts`).
"""

from __future__ import annotations

import numpy as np

from ..models.formats.quantized import InputQuant, LutQuant, QuantPlan
from .layers import layer_params
from .qlinear import QLinear, qlinear


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
