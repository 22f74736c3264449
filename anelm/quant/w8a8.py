"""W8A8's plan: which input channels stay fp16, how each input is smoothed, its static scales,
and the choice among those, made per model on held-out calibration text.

Three measures, each a knob `choose` sets by perplexity:

* kept channels: an input channel whose calibrated range exceeds OUTLIER_RATIO × the median
  channel's stays out of int8 (at most in/MAX_KEEP_FRACTION of them), in a small fp16 side
  product (kernels/qlinear.py); the rest get a scale of their own range.
* smoothing (smooth.py): s_j = max|x_j|^α / max|W_j|^(1-α), folded into the model; α per kind of
  input (after a norm, attention's output, the gated product), or none.
* two products (`fine`): the input quantized at a fine scale (its range / 127 / the FINE ratio)
  for its bulk, then what that left (the few large values past ±128 fine steps) at the coarse
  scale, both int8 times the same int8 weight, summed (kernels/qlinear.py). Static scales, one
  along the reduction axis each, as an int8 × int8 product needs. The coarse scale covers
  HEADROOM × the calibrated range: the bulk is the fine product's, so the headroom costs only
  the tails' steps, and text unlike the calibration's goes past its ranges (SmolLM2's last down
  input: 79 on the Apache license, 38 calibrated on the stories). `choose` cannot set it, its
  held-out part being the calibration text's own kind; the command's doc has its figures.

`choose` splits the calibration text: the ranges come from its first part, and every candidate
is scored on the rest (`smooth.score`, the CPU reference with the kernels' int8 roundings), the
one nearest the unquantized model's perplexity winning; it is then built from the ranges of the
whole text. One knob at a time: FINE, then α per kind (ALPHAS), 1 + 4 + 3 × 2 CPU scorings.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import numpy as np

from ..models.formats.quantized import QMAX, InputQuant, dequantize_rows, linear_names, quantize_rows
from . import smooth

OUTLIER_RATIO = 8.0  # a channel whose range exceeds this × the median channel's stays fp16
MAX_KEEP_FRACTION = 16  # ... at most in/16 channels per input
FINE = (None, 4, 8, 16)  # the bulk's scale: the range / 127 / this (None: one product)
ALPHAS = (None, 0.4, 0.7)  # smoothing strengths tried for each kind of input
FP16_TINY = 2.0 ** -14  # fp16's least normal number: a scale under it loses digits
HEADROOM = 2.0  # the coarse scale covers twice the calibrated range (module doc)
SELECT_TOKENS = 512  # at most this many calibration tokens score the candidates
MIN_SELECT = 128  # ... and fewer than this choose nothing (`held_part`)


@dataclass(frozen=True)
class Choice:
    """One candidate plan: its knobs (module doc)."""

    alpha: dict = field(default_factory=dict)  # site kind -> α (absent: not smoothed)
    fine: int | None = None
    headroom: float = HEADROOM

    def label(self) -> str:
        a = ",".join(f"{k}={v}" for k, v in sorted(self.alpha.items()) if v is not None) or "none"
        return f"alpha[{a}] fine={self.fine or 1}"

    def to_dict(self) -> dict:
        return {"alpha": {k: v for k, v in self.alpha.items() if v is not None}, "fine_ratio": self.fine,
                "coarse_headroom": self.headroom if self.fine else None}


def outliers(chan: np.ndarray) -> np.ndarray:
    """The input channels kept out of int8: the largest ranges above the ratio, capped."""
    order = np.argsort(chan)[::-1]
    over = int((chan > OUTLIER_RATIO * np.median(chan)).sum())
    return np.sort(order[:min(over, len(chan) // MAX_KEEP_FRACTION)])


def build(config, weights: dict, chan: dict, choice: Choice):
    """(smoothed float weights, {linear: (q, scale)}, {linear: InputQuant}) for `choice`, the
    channel ranges `chan` measured on the unsmoothed model."""
    fs = {s: smooth.factors(s, chan, weights, choice.alpha[s.kind]) for s in smooth.sites(config)
          if choice.alpha.get(s.kind) is not None}
    sw = smooth.fold(config, weights, fs)
    ranges = smooth.smoothed_ranges(chan, fs)
    qs, inputs = {}, {}
    for n in linear_names(config):
        keep = outliers(ranges[n])
        w = sw[n + ".weight"].copy()
        w[:, keep] = 0.0  # those columns go through the fp16 side product
        qs[n] = quantize_rows(w)
        act = max(float(np.delete(ranges[n], keep).max()), 1e-4) / QMAX
        fine = None if choice.fine is None or act / choice.fine < FP16_TINY else act / choice.fine
        inputs[n] = InputQuant(1.0, act if fine is None else act * choice.headroom, keep, fine)
    return sw, qs, inputs


def dequantized(sw: dict, qs: dict, inputs: dict) -> dict:
    """The float weights the int8 plan computes with: int8 rows dequantized, kept columns as they are."""
    out = dict(sw)
    for n, (q, scale) in qs.items():
        w = dequantize_rows(q, scale)
        keep = inputs[n].keep
        w[:, keep] = sw[n + ".weight"][:, keep]
        out[n + ".weight"] = w
    return out


def choose(config, weights: dict, chan: dict, held, seq: int, progress: bool | None = None):
    """(the best Choice, {label: perplexity ratio to the unquantized model} of every candidate,
    the unquantized perplexity), all on `held`; the best is the least |log ratio|. One knob at a
    time, the others at their best so far: the second product, then α for each kind of input."""
    from tqdm import tqdm

    kinds = sorted({s.kind for s in smooth.sites(config)})
    total = len(FINE) + len(kinds) * (len(ALPHAS) - 1) + 1
    bar = tqdm(total=total, desc="choose w8a8", unit="model", file=sys.stderr,
               disable=None if progress is None else not progress)
    source = smooth.score(config, weights, held, seq)
    bar.update()
    tried: dict[str, float] = {}

    def ratio(c: Choice) -> float:
        if c.label() not in tried:
            sw, qs, inputs = build(config, weights, chan, c)
            tried[c.label()] = smooth.score(config, dequantized(sw, qs, inputs), held, seq, inputs) / source
            bar.update()
        return tried[c.label()]

    def off(c: Choice) -> float:  # how far from the unquantized model, either way: on a random
        return abs(np.log(ratio(c)))  # model's text int8 moves perplexity down as often as up

    best = min((Choice({}, f) for f in FINE), key=off)
    for kind in kinds:
        best = min([replace(best, alpha={**best.alpha, kind: a}) for a in ALPHAS], key=off)
    bar.close()
    return best, tried, source


def held_part(calib: list[int], bos_id) -> tuple[list[int], list[int]]:
    """(the ranges' part, the choice's part) of the calibration ids: the last quarter, at most
    SELECT_TOKENS, is held out, starting with BOS where the text does (as `split_text` scores).
    Under MIN_SELECT tokens, none: the candidates' differences are then noise, and the plainest
    plan (kept channels, one product) is built from all of them. Gemma 3 270M, 256 Apache tokens
    calibrating: choosing on the last 64 took α 0.7 on down (x1.015 there), which scored x1.066
    on the next 255 tokens, against x1.030 for the plain plan."""
    n = min(len(calib) // 4, SELECT_TOKENS)
    if n < MIN_SELECT:
        return list(calib), []
    bos = calib[:1] if calib and bos_id is not None and calib[0] == bos_id else []
    return calib[:len(calib) - n], bos + calib[len(calib) - n:]

