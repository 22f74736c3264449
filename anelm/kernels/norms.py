"""Norms that hold the activations of real pretrained models in fp16.

Pretrained models carry a few residual channels in the tens of thousands (SmolLM2-135M:
27,056 on the first token from layer 11 on, measured with HF transformers; Anemll's
docs/FP16_SCALING.md lists others). The textbook RMSNorm squares its input, and in fp16 x·x
is inf once |x| > 256; a mean of squares taken by a conv also meets the accumulator limit of
32768.

So every norm first divides its input by m = max|x| along the normalised axis (floored at
2^-8, so all-zero padding columns stay finite), which puts every value in [-1, 1]:

    xs = x / m,   ms = mean(xs²) ∈ [1/C, 1],   y = xs · (ms + eps/m²)^-0.5

which is exactly x · (mean(x²) + eps)^-0.5. The division is by one number per position, so
its fp16 rounding scales xs uniformly and cancels in the normalisation; only the eps term
sees it. eps/m² is computed as (√eps · r)² with r = 1/m: r reaches 256 at the floor, and
r²·eps would pass through r² = 65536, one step past fp16's largest finite value.

Measured on SmolLM2-135M against HF float32 (tests/models, real weights): with the plain
norm 27 % of teacher-forced argmax choices agreed; with this one and the stream scale of
`layers.stream_scale_for`, the real-model aims of docs/testing.md hold (argmax agreement
≥ 98.5 %, perplexity within 1 % of HF float32).
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Value

NORM_FLOOR = 2.0 ** -8  # smallest divisor m: keeps r = 1/m at most 256 and padding columns finite


def mean_channels(b: GraphBuilder, x: Value, name: str) -> Value:
    """Mean over channels as a 1x1 conv with 1/C weights: `[1, C, 1, S]` -> `[1, 1, 1, S]`."""
    c = x.shape[1]
    return b.conv(x, np.full((1, c, 1, 1), 1.0 / c, np.float32), name=name)


def scaled_rms(b: GraphBuilder, x: Value, axis: int, eps: float, name: str) -> Value:
    """x · (mean(x²) + eps)^-0.5 along `axis`, with x divided by max|x| first (module doc)."""
    m = b.maximum(b.reduce_max(b.abs(x, name=f"{name}_abs"), axes=[axis], name=f"{name}_max"),
                  NORM_FLOOR, name=f"{name}_m")
    r = b.pow(m, -1.0, name=f"{name}_r")
    xs = b.mul(x, r, name=f"{name}_xs")
    sq = b.mul(xs, xs, name=f"{name}_sq")
    if axis == 1:  # channels: one conv instead of a sum and a scale
        ms = mean_channels(b, sq, f"{name}_ms")
    else:
        ms = b.mul(b.reduce_sum(sq, axes=[axis], name=f"{name}_ss"), 1.0 / x.shape[axis], name=f"{name}_ms")
    er = b.mul(r, math.sqrt(eps), name=f"{name}_er")  # √eps / m
    rstd = b.pow(b.add(ms, b.mul(er, er, name=f"{name}_eps"), name=f"{name}_mse"), -0.5, name=f"{name}_rstd")
    return b.mul(xs, rstd, name=name)


def channel_norm(b: GraphBuilder, x: Value, eps: float, center: bool, name: str) -> Value:
    """RMSNorm, or LayerNorm when `center`, over the channels of `[1, C, 1, S]`, without the
    affine (folded into the next linear by `layers.layer_params`)."""
    if center:  # the mean is at most max|x|, so the conv cannot reach the accumulator limit first
        x = b.sub(x, mean_channels(b, x, f"{name}_mean"), name=f"{name}_cent")
    return scaled_rms(b, x, 1, eps, name)


def head_rms_norm(b: GraphBuilder, x: Value, weight: np.ndarray, eps: float, name: str) -> Value:
    """RMSNorm over Dh of a `[Hkv, G, Dh, S]` tensor with its gain (Qwen3's q/k norm)."""
    dh = x.shape[2]
    w = b.weight(f"{name}_w", np.reshape(weight, (1, 1, dh, 1)))
    return b.mul(scaled_rms(b, x, 2, eps, f"{name}_n"), w, name=name)


def plain_rms(b: GraphBuilder, x: Value, weight, eps: float = 1e-5, name: str = "rms") -> Value:
    """x · (Σc x² · 1/C + eps)^-0.5 · w over channels, unscaled, from ANE-safe ops (Orion's
    rmsnorm builder, maderix/ANE's static MIL): the form the published reference programs use
    (`bench/maderix_static.py`), and a small realistic graph for the compiler's tests. It
    overflows fp16 once Σ x² passes 65504, which is why the kernels use `channel_norm`."""
    p, c = b.graph.peek_name(name), x.shape[1]
    ss = b.reduce_sum(b.mul(x, x, name=f"{p}_sq"), axes=[1], name=f"{p}_ss")
    ms = b.mul(ss, b.scalar(1.0 / c, x.dtype, f"{p}_invd"), name=f"{p}_ms")
    mse = b.add(ms, b.scalar(eps, x.dtype, f"{p}_eps"), name=f"{p}_mse")
    rrms = b.pow(mse, b.scalar(-0.5, x.dtype, f"{p}_nhalf"), name=f"{p}_rrms")
    if weight is None:
        return b.mul(x, rrms, name=p)
    w = weight if isinstance(weight, Value) else b.weight(f"{p}_w", np.reshape(weight, (1, c, 1, 1)), x.dtype)
    return b.mul(b.mul(x, rrms, name=f"{p}_xr"), w, name=p)
