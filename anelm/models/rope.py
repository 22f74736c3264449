"""RoPE's frequencies for every family: HF's `rope_parameters` (a `rope_type` and its keys) ->
the per-pair inverse frequencies [dim/2] and the attention factor, one table of rope types.

HF's `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` is the oracle (a test compares
both results for every type). Each type computes in float32 in HF's order of operations, so
the tables agree with HF's to float32 rounding.

- The attention factor (YaRN's and LongRoPE's gain on cos and sin) multiplies q and k both
  after RoPE: the scores by its square. The runners fold it into the score scale
  (`Family.attention_scale`, the CPU references' `scales`) instead of the tables.
- `dynamic` (NTK) raises the base only once a sequence passes `max_position_embeddings`, which
  is the context anelm gives a model: inside it the frequencies are the plain ones, as HF's are
  until then.
- `longrope` (Phi-3): HF picks the factors per forward pass from its length, max(position) + 1:
  `short_factor` up to `original_max_position_embeddings`, `long_factor` past it, for every
  position of the pass; its generation drops the KV cache when a sequence first passes the
  original context, so from then on every key is the long factors'. The rule here: a sequence
  of n positions runs with the long factors when n > original, as a whole (the CPU reference,
  `phi3.Model`, runs a sequence again from position 0 the step it passes, as HF does);
  `config.at_length(n)` is the config whose tables (taken with no length) are those. The
  attention factor comes from `factor` (max / original context when absent), as HF's. Only an
  architecture that runs this rule takes the type (`standardize`'s `runnable`).
- `partial_rotary_factor` (Phi-4-mini: 0.75) rotates the first rot = head_dim·factor dimensions
  of each head, pairing i with i + rot/2 (HF's rotate_half on that slice). Frequencies are then
  returned for the whole head, the rotated pairs first and 0 (cos 1, sin 0: the identity) for
  the rest, so the tables pair i with i + head_dim/2 as for a full rotation: the model lays each
  q and k head out so that those pairs are HF's (`phi3.py` permutes the rows at load). Only an
  architecture that does so takes the factor (`standardize` refuses it in a config's scaling).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

F32 = np.float32


def _powers(base: float, dim: int) -> np.ndarray:
    """θ^(2i/dim) for each pair i, in float32 as HF computes it."""
    return F32(base) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim))


def _default(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    return F32(1.0) / _powers(base, dim), 1.0


def _none(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    """No rotation (SmolLM3's NoPE layers): every frequency 0, so cos 1 and sin 0."""
    return np.zeros(dim // 2, F32), 1.0


def _linear(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    """Positions divided by `factor` (the inverse frequencies, equivalently)."""
    return (F32(1.0) / _powers(base, dim)) / F32(p["factor"]), 1.0


def _dynamic(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    """NTK: the base grows with the sequence once it passes `max_position_embeddings`."""
    if seq_len is not None and max_pos is not None and seq_len > max_pos:
        f = p["factor"]
        base = base * ((f * seq_len / max_pos) - (f - 1)) ** (dim / (dim - 2))
    return _default(p, dim, base, seq_len, max_pos)


def _yarn_gain(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    """Interpolated (slowed by `factor`) below the band of rotations [beta_slow, beta_fast]
    over the original context, extrapolated (kept) above it, a linear ramp between."""
    factor, old = p["factor"], p["original_max_position_embeddings"]
    gain = p.get("attention_factor")
    if gain is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        gain = _yarn_gain(factor, m) / _yarn_gain(factor, m_all) if m and m_all else _yarn_gain(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the pair index that turns `rotations` times over `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos = _powers(base, dim)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
    keep = F32(1.0) - ramp  # the share of the original frequency
    inv = (F32(1.0) / (F32(factor) * pos)) * (F32(1.0) - keep) + (F32(1.0) / pos) * keep
    return inv, float(gain)


def _longrope(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    """Per-pair factors: `short_factor` up to the original context, `long_factor` past it."""
    old = p["original_max_position_embeddings"]
    gain = p.get("attention_factor")
    if gain is None:
        f = p.get("factor") or (max_pos / old if max_pos else 1.0)
        gain = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(old))
    factors = np.asarray(p["long_factor"] if seq_len and seq_len > old else p["short_factor"], F32)
    return F32(1.0) / (factors * _powers(base, dim)), float(gain)


def _llama3(p: dict, dim: int, base: float, seq_len: int | None, max_pos: int | None):
    """Llama 3.1: wavelengths longer than the original context / low_freq_factor slowed by
    `factor`, shorter than it / high_freq_factor kept, the band between blended."""
    inv = F32(1.0) / _powers(base, dim)
    factor, lo, hi, old = (p[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                          "original_max_position_embeddings"))
    wavelen = F32(2 * math.pi) / inv
    slowed = np.where(wavelen > F32(old / lo), inv / F32(factor), inv)
    smooth = (F32(old) / wavelen - F32(lo)) / F32(hi - lo)
    blended = (F32(1.0) - smooth) * slowed / F32(factor) + smooth * slowed
    medium = ~(wavelen < F32(old / hi)) & ~(wavelen > F32(old / lo))
    return np.where(medium, blended, slowed), 1.0


Init = Callable[[dict, int, float, "int | None", "int | None"], tuple[np.ndarray, float]]
# rope_type -> (the keys it requires besides rope_theta, its frequencies)
ROPE_TYPES: dict[str, tuple[tuple[str, ...], Init]] = {
    "default": ((), _default),
    "none": ((), _none),  # a layer's own, never a config's (NOPE)
    "linear": (("factor",), _linear),
    "dynamic": (("factor",), _dynamic),
    "yarn": (("factor", "original_max_position_embeddings"), _yarn),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), _longrope),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), _llama3),
}
RUNNABLE = ("default", "linear", "dynamic", "yarn", "llama3")  # longrope: only where the config says (Phi-3)
NOPE = {"rope_type": "none"}  # the RoPE of a layer without it (`config.rope(i)`)
WITH_ORIGINAL = ("llama3", "yarn", "longrope")  # original_max_position_embeddings defaults to the context


def rope_type(scaling: dict | None) -> str:
    s = scaling or {}
    return s.get("rope_type", s.get("type", "default"))


def standardize(scaling: dict | None, max_position_embeddings: int,
                runnable: tuple[str, ...] = RUNNABLE) -> tuple[dict | None, str | None]:
    """(HF's parameters completed as HF completes them, or None for plain RoPE; a one-line
    problem or None): `original_max_position_embeddings` defaults to the context, a missing
    YaRN or LongRoPE `factor` to the context over it; a type not in `runnable` (the
    architecture's: LongRoPE needs runners that switch factors per sequence, Phi-3's) or a
    missing key is the problem."""
    kind = rope_type(scaling)
    if kind not in runnable:
        return None, f"unsupported rope_type {kind!r}: expected one of {', '.join(runnable)}"
    if kind == "default":
        return None, None
    p = {**scaling, "rope_type": kind}
    p.pop("type", None)
    if kind in WITH_ORIGINAL:
        p.setdefault("original_max_position_embeddings", max_position_embeddings)
    if kind in ("yarn", "longrope") and p.get("factor") is None:
        p["factor"] = max_position_embeddings / p["original_max_position_embeddings"]
    missing = [k for k in ROPE_TYPES[kind][0] if p.get(k) is None]
    if missing:
        return None, f"rope_type {kind!r} needs {', '.join(missing)}"
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        return None, f"partial_rotary_factor {p['partial_rotary_factor']} is not supported: expected RoPE over the whole head"
    return p, None


def llama3_from_divisors(divisors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Llama 3's parameters from llama.cpp's per-pair divisors of the plain frequencies (its
    `rope_freqs` tensor: 1 for short wavelengths, `factor` for long ones, the blend between), or
    None when they are not Llama 3's. The blend's line in 1/wavelength fixes
    original_max / (high - low) and low / (high - low); with low_freq_factor 1 (every Llama 3's)
    they give the other two, and the same divisors recomputed from them are the check."""
    r = np.asarray(divisors, np.float64).reshape(-1)
    wavelen = 2 * math.pi * _powers(theta, head_dim).astype(np.float64)
    factor = round(float(r.max()), 4) if r.size else 0.0  # float32 of 8.0 or 32.0
    mid = (r > 1 + 1e-4) & (r < factor * (1 - 1e-4))
    if r.shape != wavelen.shape or factor <= 1 or mid.sum() < 2:
        return None
    smooth = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)  # the blend: r = 1 / ((1 - s) / factor + s)
    slope, offset = np.polyfit(1 / wavelen[mid], smooth, 1)
    if offset >= 0 or slope <= 0:
        return None
    p = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": round(1 - 1 / offset, 4),
         "original_max_position_embeddings": int(round(-slope / offset))}
    scaled = _llama3(p, head_dim, theta, None, None)[0]
    return p if np.allclose(_default(p, head_dim, theta, None, None)[0] / scaled, r, rtol=1e-4) else None


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None, seq_len: int | None = None,
                     max_position_embeddings: int | None = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [dim/2], attention factor) of RoPE with base `theta` and
    HF's `scaling` parameters (None: plain), for a sequence of `seq_len` positions (None: any
    within the context; only `dynamic` and `longrope` look at it)."""
    kind = rope_type(scaling)
    dim = int(head_dim * (scaling or {}).get("partial_rotary_factor", 1.0))
    part, gain = ROPE_TYPES[kind][1](scaling or {}, dim, float(theta), seq_len, max_position_embeddings)
    inv = np.zeros(head_dim // 2, F32)
    inv[:dim // 2] = part  # a partial rotation's other pairs turn by 0 (module doc)
    return inv, float(gain)
