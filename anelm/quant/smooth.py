"""W8A8's activation smoothing (SmoothQuant) and the CPU model that scores a W8A8 plan.

Smoothing divides input channel j of a linear by s_j and multiplies the weight's column j by
s_j, W·x = (W·diag s)·(x/s), so a channel whose range is far above the others' (SmolLM2's layer
11 down projection: 3,323 against a median of 1.1) no longer sets the one int8 scale of its
tensor. s_j = max|x_j|^α / max|W_j|^(1-α), the column maximum taken over every linear reading x,
then divided by the factors' geometric mean (a common factor moves into the activation scale and
the weight rows' scales anyway; centred, no fp16 gain or row scale lands among the subnormals).

Where x/s is made (`sites`), exactly and without a new op or a new tensor in the folder:

    qkv, gate/up (fc)   the norm before them: its gain (and LayerNorm's shift) divided by s
    o                   attention's output: v's rows divided by s (each head's output is a sum
                        of its kv head's v rows), so the heads sharing a kv head (GQA) share
                        one s per head dimension: the range and column maximum over the group
    down                the gated product act(gate x) ⊙ (up x): up's rows divided by s
    GPT-2's proj        not smoothed: gelu(fc x) has no factor to fold into

Folding into rows keeps those rows' int8 exact (a row times one factor requantizes to the same
int8, models/formats/quantized.py), and the folder is an ordinary W8A8 folder: its norm gains, v and up
rows carry 1/s, its consumers' int8 rows carry s, and every reader computes the same model.
The kernel's other way to divide an input, a per-channel multiply (`QLinear.in_gain`), gives
the same float model but needs a tensor per linear in the folder that its layout lacks, and
only o could use it differently (s per channel rather than per kv group); the command's doc has
what that measured.

`score` is the float32 CPU reference with the roundings the W8A8 kernels apply: each linear's
weights as their int8 rows dequantized (the kept channels' columns as they are), each input
rounded half to even at its fp16 activation scale and saturated to [-128, 127] (with a fine
scale: first at it, then what that left at the coarse one, kernels/qlinear.py), the kept channels
left alone; GPT-2's LayerNorm shift is taken off first (it is in the bias, kernels/int8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.families import family_for
from ..models.names import MODULES, module_name

TINY = 1e-5  # floor of a range or a column maximum in the factors (a dead channel: s stays finite)


@dataclass(frozen=True)
class Site:
    """One smoothed input: the linears that read it and the tensor that makes it."""

    kind: str  # "norm" (qkv, gate/up, fc), "o" or "down": smoothed with one α a kind
    consumers: tuple[str, ...]  # HF linear names (their weights' columns take s)
    producer: str  # HF module whose weight takes 1/s: a norm (its gain) or a linear (its rows)
    norm: bool  # producer is a norm, else a linear's rows
    rows: tuple[int, int] | None = None  # the producer's rows that make x (GPT-2: v's third of c_attn)
    group: int = 1  # heads sharing one set of v rows: s repeats over them
    head_dim: int = 0


def sites(config) -> list[Site]:
    """Every input smoothing can fold into the model (module doc), layer by layer."""
    mt, f = config.model_type, family_for(config.model_type)
    mods, out = MODULES[mt], []
    for i in range(config.num_hidden_layers):
        name = lambda role: module_name(mt, i, role)  # noqa: E731
        readers: dict[str, tuple[str, ...]] = {}  # norm -> every linear reading it (gate and up: one input)
        for key, roles in f.slot_roles.items():
            norm = f.reads_norm(key)
            if norm is not None:
                readers[norm] = readers.get(norm, ()) + tuple(name(r) for r in roles)
        out += [Site("norm", cons, name(norm), True) for norm, cons in readers.items()]
        if "v" in mods:
            group = config.num_attention_heads // config.num_key_value_heads
            out.append(Site("o", (name("o"),), name("v"), False, None, group, config.head_dim))
        else:  # GPT-2: v is the last third of c_attn's rows, one kv head per head
            d = config.hidden_size
            out.append(Site("o", (name("o"),), name("qkv"), False, (2 * d, 3 * d), 1, config.head_dim))
        if f.gated:
            out.append(Site("down", (name("down"),), name("up"), False))
    return out


def _grouped(v: np.ndarray, site: Site) -> np.ndarray:
    """Per-channel values -> their maximum over the heads sharing a kv head, [kv · head_dim]."""
    if site.group == 1:
        return v
    hd = site.head_dim
    return v.reshape(-1, site.group, hd).max(axis=1).reshape(-1)


def _spread(s: np.ndarray, site: Site) -> np.ndarray:
    """Factors per kv channel -> per input channel of o (each head its kv head's)."""
    if site.group == 1:
        return s
    hd = site.head_dim
    return np.repeat(s.reshape(-1, 1, hd), site.group, axis=1).reshape(-1)


def factors(site: Site, chan: dict[str, np.ndarray], weights: dict[str, np.ndarray], alpha: float) -> np.ndarray:
    """s [producer's channels] for `site` (module doc); α = 0 would still balance the columns, so
    no smoothing at all is α None, not α 0."""
    x = _grouped(np.maximum(chan[site.consumers[0]], TINY).astype(np.float64), site)
    col = np.max([np.abs(weights[n + ".weight"]).max(axis=0) for n in site.consumers], axis=0)
    w = _grouped(np.maximum(col, TINY).astype(np.float64), site)
    s = x ** alpha / w ** (1.0 - alpha)
    return s / np.exp(np.log(s).mean())


def fold(config, weights: dict[str, np.ndarray], fs: dict[Site, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights with each site's 1/s in its producer and s in its consumers' columns: the same
    float model (equal up to float32 rounding)."""
    out, offset = dict(weights), np.float32(family_for(config.model_type).gain_offset)
    for site, s in fs.items():  # out, not weights: c_attn and up both make one input and read another
        s32 = s.astype(np.float32)
        wk, bk = site.producer + ".weight", site.producer + ".bias"
        if site.norm:  # a gain stored as w, applied as offset + w (Gemma: 1 + w)
            out[wk] = ((out[wk] + offset) / s32 - offset).astype(np.float32)
            if bk in out:  # LayerNorm's shift
                out[bk] = (out[bk] / s32).astype(np.float32)
        else:  # s is per producer row (per kv head's channel)
            rows = slice(*site.rows) if site.rows else slice(None)
            for k, div in ((wk, s32[:, None]), (bk, s32)):
                if k in out:
                    v = out[k].copy()
                    v[rows] = v[rows] / div
                    out[k] = v
        cons = _spread(s, site).astype(np.float32)
        for n in site.consumers:
            out[n + ".weight"] = (out[n + ".weight"] * cons[None, :]).astype(np.float32)
    return out


def smoothed_ranges(chan: dict[str, np.ndarray], fs: dict[Site, np.ndarray]) -> dict[str, np.ndarray]:
    """The channel ranges of the smoothed inputs: x/s is exact in float, so the calibrated
    ranges divided by s, with no second calibration pass."""
    out = dict(chan)
    for site, s in fs.items():
        spread = _spread(s, site).astype(np.float32)
        for n in site.consumers:
            out[n] = chan[n] / spread
    return out


def score(config, weights: dict[str, np.ndarray], ids, seq: int, inputs: dict | None = None) -> float:
    """Perplexity of `ids` in windows of `seq` on the CPU reference with `weights`; with
    `inputs` ({linear: InputQuant}), each linear's input rounded as the W8A8 kernels round it
    (module doc; `weights` then hold the dequantized int8 rows)."""
    from ..generate.perplexity import token_nll, windows
    from ..models.loading import build_model
    from ..models.names import layer_prefix
    from .calibrate import norm_shifts

    model = build_model(config, weights)
    if inputs is not None:
        plain, shifts, mt = model.project, norm_shifts(config, weights), config.model_type

        def project(i: int, name: str, x: np.ndarray) -> np.ndarray:
            key = layer_prefix(mt, i) + name
            iq, shift = inputs[key], shifts.get(key, np.float32(0))
            v, q = x - shift, 0.0
            for a in (iq.act_scale,) if iq.fine is None else (iq.fine, iq.act_scale):  # what each product left
                a = np.float32(np.float16(a))
                q = q + np.clip(np.round((v - q) / a), -128, 127) * a
            if iq.keep is not None and len(iq.keep):
                q[:, iq.keep] = v[:, iq.keep]
            return plain(i, name, (q + shift).astype(np.float32))

        model.project = project
    nll = []
    for w in windows(ids, seq):
        logits = model.prefill(list(w), model.new_cache())
        nll.append(token_nll(logits[:-1], np.asarray(w[1:])))
    return float(np.exp(np.concatenate(nll).mean()))
