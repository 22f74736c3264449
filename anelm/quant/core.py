"""Per-output-channel symmetric int8, and the int8 linear a kernel carries (`QLinear`).

A weight row w is stored as q = round(w / s) with s = max|w| / 127, q in [-127, 127]: symmetric,
zero point 0, so a row's largest weight is exactly ±127 and the row scale is recovered from the
dequantized row as max|q·s| / 127. That is what lets the kernels be built from the dequantized
weights (`kernel_layer`): the folds `layer_params` applies to a projection with unit norm gains
(the attention scale, the residual stream scale; quant/fold.py) multiply whole rows by one
factor each, so requantizing a folded row gives back the same q with the factor in its scale, bit for
bit (tests/quant). One rounding rule, half to
even (np.round), as the MIL reference quantizes; `maderix` rounds half away from zero, which
differs only at exact ties and is immaterial for weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

QMAX = 127  # symmetric: -128 is never used, so negating a row never overflows


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out]) with w ≈ q · scale[:, None].
    An all-zero row gets scale 1 (q = 0), so every scale is a positive number."""
    w = np.asarray(w, np.float32)
    peak = np.abs(w).max(axis=1)
    scale = np.where(peak > 0, peak / np.float32(QMAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def power_of_two_above(x: float) -> float:
    """The smallest power of two >= x (>= 1): an exact factor to move between two operands."""
    return 1.0 if x <= 1.0 else float(2.0 ** math.ceil(math.log2(x)))


@dataclass(frozen=True)
class QLinear:
    """One kernel linear in int8, `[out, in]`, as `anelm.quant.graph.quant_linear` emits it.

    W8 (act_scale None): the conv sums q·x in the fp16 accumulator before the row scale
    (peer-facts §4.9), so x is first divided by `shift`, a power of two that keeps that sum
    under the 32768 limit (strict §2.9), and the row scale carries it back: exact both ways.
    W8A8: x is quantized to int8 at the static per-tensor `act_scale`; the input channels in
    `keep` (activation outliers that one int8 scale cannot hold with the rest) are left out of
    int8: their weight columns are zero in q, and `keep_w` [out, len(keep)] multiplies them in
    fp16 beside the int8 product.
    """

    q: np.ndarray  # int8 [out, in]
    scale: np.ndarray  # float32 [out]
    shift: float = 1.0
    act_scale: float | None = None
    keep: np.ndarray | None = None  # int [k] input channels in fp16
    keep_w: np.ndarray | None = None  # float32 [out, k]
    in_gain: np.ndarray | None = None  # float32 [in]: the norm gain on the input (quant/fold.py)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


@dataclass(frozen=True)
class InputQuant:
    """What calibration decided for one linear input (shared by the projections that read it)."""

    shift: float = 1.0  # W8
    act_scale: float | None = None  # W8A8
    keep: np.ndarray | None = None  # W8A8 outlier channels


def qlinear(w: np.ndarray, iq: InputQuant, gain: np.ndarray | None = None) -> QLinear:
    """The int8 form of a float [out, in] linear for the input decided by `iq`."""
    keep_w = None
    if iq.keep is not None and len(iq.keep):
        keep_w = np.ascontiguousarray(w[:, iq.keep], np.float32)
        w = w.copy()
        w[:, iq.keep] = 0.0  # those channels go through the fp16 side product
    q, scale = quantize_rows(w)
    keep = None if keep_w is None else np.asarray(iq.keep, np.int64)
    return QLinear(q, scale, iq.shift, iq.act_scale, keep, keep_w, gain)


def kernel_layer(p: dict, inputs: dict[str, InputQuant], gains: dict[str, np.ndarray]) -> dict:
    """`layer_params` output {name: (W, b)} (built with unit norm gains) -> the same with QLinear
    for every name in `inputs` (the kernel's linears: qkv, o, gate, up, down), each carrying
    the gain its input needs; Qwen3's q/k norms and the rest pass through."""
    return {k: (qlinear(w, inputs[k], gains.get(k)), b) if k in inputs else (w, b) for k, (w, b) in p.items()}
