"""The layer library of the inference kernels: shape, folded weights, and the graph pieces
(norm, projections, RoPE, attention, MLP, residual) that prefill (`prefill.py`) and decode
(`decode.py`) build their layers from.

RoPE is applied at full head width, so that the rotated keys are ONE tensor the cache can take:
    x' = x·cos + rotate_half(x)·sin,  rotate_half(x) = [−x2, x1] = P·x
where P is a const signed permutation `[Dh, Dh]` applied by a matmul over Dh. Each output
element is one ±input, so the matmul is exact in fp16, and no concat is needed to join halves.

Every op costs a pass over its result (on the emulator, a rounding to fp16 each), so the
layer is written with few: `layer_params` folds the norm gains (and LayerNorm's shift) into
the projections that follow them and the attention scale into the query projection, channel
means are 1x1 convs with 1/C weights (one op instead of a sum and a scale), and GELU's tanh
form is x·sigmoid(2u), the same function as 0.5·x·(1 + tanh u) in six ops instead of nine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..fp16.bits import fold_to_half, to_half
from ..ir.builder import GraphBuilder
from ..ir.graph import Value
from ..mil.blob import blob_payload, seal
from ..models.layers import rope_full_width
from .families import Family, family_for
from .lora import add_lora
from .norms import channel_norm, head_rms_norm
from .qlinear import QLinear, quant_linear


@dataclass(frozen=True)
class LayerShape:
    """What a layer kernel needs to know besides its weights."""

    family: Family  # how the layer differs by architecture (`kernels/families/`)
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention score scale (`Family.attention_scale`)
    stream_scale: float = 1.0  # the kernels carry the residual stream divided by this (see stream_scale_for)
    window: int | None = None  # a sliding window: the keys a query sees, itself included (Gemma's local layers)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def kv_channels(self) -> int:
        return self.kv_heads * self.head_dim


def layer_shape(config, index: int = 0) -> LayerShape:
    """The LayerShape of layer `index` of a model config (anelm.models.config)."""
    f = family_for(config.model_type)
    return LayerShape(f, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                      config.head_dim, float(f.norm_eps(config)), f.attention_scale(config, index),
                      window=config.window(index))


STREAM_PEAK = 4096.0  # the largest stream value the kernels should carry (stream_scale_for)
STREAM_BOUND = 32768.0  # the most a bound on the stream may reach inside the kernels: half of fp16's range


def stream_scale_for(peak: float, bound: float | None = None) -> float:
    """The power of two S by which the kernels divide the residual stream, for a model whose
    stream (or a layer's update to it) reaches `peak` (`CausalLM.stream_peak`).

    The o and down projections write into the stream, so their results, conv/matmul sums, must
    stay under the accumulator limit of 32768, and the stream itself under fp16's 65504.
    Dividing by S is exact (a power of two) and free: S is folded into those projections'
    weights and into eps, and every read of the stream goes through a norm, which does not see
    the scale. STREAM_PEAK leaves 8x headroom over the calibration for prompts that push
    further. SmolLM2-135M peaks at 27,056 and gets S = 8; random test models get S = 1.

    `bound`: where the architecture can bound the stream from its weights, whatever the input
    (`CausalLM.stream_bound`: post-norm models add at most √C times a post-norm's largest gain
    per layer), S also keeps that bound under half of fp16's range: no prompt can overflow it.
    Gemma 3 270M measures 103,795 (S = 32) against a bound of 511,630 (S = 16): S = 32.
    """
    s = 1.0 if peak <= STREAM_PEAK else float(2.0 ** math.ceil(math.log2(peak / STREAM_PEAK)))
    if bound is not None and bound > STREAM_BOUND * s:
        s = float(2.0 ** math.ceil(math.log2(bound / STREAM_BOUND)))
    return s


# --- weights -------------------------------------------------------------------------------

def _fold(w: np.ndarray, b: np.ndarray | None, gain: np.ndarray, shift: np.ndarray | None,
          out: np.ndarray, scale: float | None = None):
    """W·(g ⊙ n + s) + b = (W·diag g)·n + (W·s + b): the norm's affine moved into the linear, times
    `scale` (q's attention scale); W·diag g into `out`, float32 or fp16 (as the chip holds it)."""
    if out.dtype == np.float16:
        fold_to_half(w, gain, None if scale is None else np.full(w.shape[0], scale, np.float32), out=out)
    else:
        np.multiply(w, gain[None, :], out=out)
        if scale is not None:
            out *= np.float32(scale)
    bias = b if shift is None else (w @ shift + (0.0 if b is None else b)).astype(np.float32)
    return out, bias if bias is None or scale is None else bias * np.float32(scale)


def layer_params(s: LayerShape, w: dict[str, np.ndarray], half: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """HF weights of one layer (names inside the layer, `[out, in]`) -> {linear: (W, bias or None)}
    with the norm affines and the attention scale folded in; "q_norm"/"k_norm" hold Qwen3's
    per-head gains as (gain, None). Matrices are float32, or with `half` fp16, cast as they fold
    and held (read-only) as the payloads of their own BLOBFILEs (`mil.blob.blob_payload`): the
    programs' blobs are these buffers, not copies of them."""
    f = s.family
    raw = f.linears(w, s.d)
    norm1, norm2 = f.affine(w, "attn_norm"), f.affine(w, "mlp_norm")  # (gain, LayerNorm's shift or None)
    new = (lambda shape: blob_payload(shape, "fp16")) if half else (lambda shape: np.empty(shape, np.float32))
    done = seal if half else (lambda a: a)
    # RoPE is linear, so scaling q before it is scaling the scores; Qwen3's goes after its q norm
    q_scale = None if f.head_norms(w) else s.scale
    # one projection for q, k and v (rows [q | k | v]): one conv and one bias add instead of three
    ends = np.cumsum([raw[n][0].shape[0] for n in "qkv"])
    fused = new((int(ends[-1]), raw["q"][0].shape[1]))
    parts = [_fold(*raw[n], *norm1, fused[end - len(raw[n][0]):end], q_scale if n == "q" else None)
             for n, end in zip("qkv", ends)]
    bias = None if all(pb is None for _, pb in parts) else \
        np.concatenate([np.zeros(pw.shape[0], np.float32) if pb is None else pb for pw, pb in parts])
    p = {}
    for n in f.mlp_inputs:
        fw, fb = _fold(*raw[n], *norm2, new(raw[n][0].shape))
        p[n] = (done(fw), fb)
    for n in raw:
        if n not in p and n not in ("q", "k", "v"):
            pw, pb = raw[n]
            if n in f.stream_writers and s.stream_scale != 1.0:
                pw, pb = pw / np.float32(s.stream_scale), None if pb is None else pb / np.float32(s.stream_scale)
            p[n] = (done(to_half(pw, out=new(pw.shape))) if half else pw, pb)
    for n in f.post_norms:  # Gemma: these write the stream, so its scale goes into their gains
        p[n] = (f.affine(w, n)[0] / np.float32(s.stream_scale), None)
    if q_scale is None:  # Qwen3: the scale goes after the q norm, into its gain
        p["q_norm"] = (f.affine(w, "q_norm")[0] * np.float32(s.scale), None)
        p["k_norm"] = (f.affine(w, "k_norm")[0], None)
    p["qkv"] = (done(fused), bias)
    return p


# --- graph pieces --------------------------------------------------------------------------

def rope_full_tables(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF's per-pair tables [T, Dh/2] -> full-width [1, 1, Dh, T] (each pair angle twice)."""
    return rope_full_width(cos)[None, None], rope_full_width(sin)[None, None]


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """P [1, 1, Dh, Dh] with P·x = [−x2, x1] over Dh."""
    half = head_dim // 2
    p = np.zeros((head_dim, head_dim), np.float32)
    p[np.arange(half), np.arange(half) + half] = -1.0
    p[np.arange(half) + half, np.arange(half)] = 1.0
    return p[None, None]


def apply_rope(b: GraphBuilder, x: Value, cos: Value, sin: Value, rot: Value, name: str) -> Value:
    """x·cos + (P·x)·sin for heads `[Hkv, G, Dh, S]`; cos/sin broadcast as `[1, 1, Dh, S]`."""
    turned = b.matmul(rot, x, name=f"{name}_rot")  # [1,1,Dh,Dh] @ [Hkv,G,Dh,S] -> [Hkv,G,Dh,S]
    return b.add(b.mul(x, cos, name=f"{name}_c"), b.mul(turned, sin, name=f"{name}_s"), name=name)


def _lin(b: GraphBuilder, x: Value, p: dict, key: str, lora: dict | None = None) -> Value:
    """Projection `key` of x, plus its LoRA term where `lora` (`kernels/lora.py`) has a slot for it."""
    w, bias = p[key]
    if isinstance(w, QLinear):  # quantized weights (kernels/qlinear.py): the chip's forms
        return quant_linear(b, x, w, bias, name=f"{key}_proj")
    return add_lora(b, b.linear(x, w, bias, name=f"{key}_proj"), x, lora, key)


def declare_inputs(b: GraphBuilder, shapes: dict[str, list[int]]) -> dict[str, Value]:
    """Declare a kernel's inputs in alphabetical order, the order strict binds them in."""
    return {n: b.input(n, shapes[n]) for n in sorted(shapes)}


def stream_norm(b: GraphBuilder, s: LayerShape, x: Value, name: str) -> Value:
    """The layer's norm of the (scaled) residual stream: eps scales with the stream's square."""
    return channel_norm(b, x, s.eps / s.stream_scale ** 2, s.family.layer_norm, name)


def layer_front(b: GraphBuilder, s: LayerShape, p: dict, x: Value, rope: tuple[Value, Value] | None,
                lora: dict | None = None) -> tuple[Value, Value, Value, Value, Value]:
    """Norm, Q/K/V projections, Qwen3's q/k norms and RoPE for x `[1, D, 1, S]`; `lora`: the
    adapter inputs by projection (`lora.slot_values`), None for the base alone.

    Returns (q heads `[Hkv, G, Dh, S]`, k heads `[Hkv, 1, Dh, S]`, v heads `[Hkv, 1, Dh, S]`,
    then k and v as the cache stores them: heads `[Hkv, 1, Dh, S]`, the bytes of `[1, C, 1, S]`).
    """
    seq, hd, kv, h = x.shape[3], s.head_dim, s.kv_heads, s.heads
    qkv = _lin(b, stream_norm(b, s, x, "attn_norm"), p, "qkv", lora)
    heads = b.reshape(qkv, [h + 2 * kv, 1, hd, seq], name="qkv_heads")  # [1,(H+2Hkv)·Dh,1,S] -> [H+2Hkv,1,Dh,S]
    qh = b.slice_by_size(heads, [0, 0, 0, 0], [h, 1, hd, seq], name="q_heads")  # [H,1,Dh,S]
    kh = b.slice_by_size(heads, [h, 0, 0, 0], [kv, 1, hd, seq], name="k_heads")  # [Hkv,1,Dh,S]
    vh = b.slice_by_size(heads, [h + kv, 0, 0, 0], [kv, 1, hd, seq], name="v_heads")  # [Hkv,1,Dh,S]
    if s.groups > 1:  # query head kv·G + g reads KV head kv (HF's GQA order)
        qh = b.reshape(qh, [kv, s.groups, hd, seq], name="q_groups")  # [H,1,Dh,S] -> [Hkv,G,Dh,S]
    if "q_norm" in p:  # Qwen3: RMSNorm over Dh per head, before RoPE
        qh = head_rms_norm(b, qh, p["q_norm"][0], s.eps, "q_norm")
        kh = head_rms_norm(b, kh, p["k_norm"][0], s.eps, "k_norm")
    if rope is not None:
        rot = b.const(rotate_half_matrix(hd), name="rotate_half", dtype="fp16", blob=True)
        qh = apply_rope(b, qh, rope[0], rope[1], rot, "q_rope")
        kh = apply_rope(b, kh, rope[0], rope[1], rot, "k_rope")
    return qh, kh, vh, kh, vh


def post_norm(b: GraphBuilder, s: LayerShape, p: dict, y: Value, role: str) -> Value:
    """A sub-block's output normed before the residual add, where the family has such a norm
    (Gemma's): RMSNorm times the gain, which carries the stream's scale (`layer_params`)."""
    if role not in p:
        return y
    gain = b.weight(f"{role}_w", np.reshape(p[role][0], (1, s.d, 1, 1)))
    return b.mul(channel_norm(b, y, s.eps, False, f"{role}_n"), gain, name=role)


def layer_back(b: GraphBuilder, s: LayerShape, p: dict, x: Value, attn: Value, lora: dict | None = None) -> Value:
    """Output projection and residual, then norm, MLP and residual: the next hidden state."""
    x2 = b.add(x, post_norm(b, s, p, _lin(b, attn, p, "o", lora), "attn_post_norm"), name="resid1")
    m = s.family.mlp(b, stream_norm(b, s, x2, "mlp_norm"), lambda v, key: _lin(b, v, p, key, lora))
    return b.add(x2, post_norm(b, s, p, m, "mlp_post_norm"), name="resid2")


def full_attention(b: GraphBuilder, s: LayerShape, qh: Value, kh: Value, vh: Value, mask: Value) -> Value:
    """softmax(QᵀK + mask)·V over one sequence (q pre-scaled); returns `[1, H·Dh, 1, S]`."""
    seq = qh.shape[3]
    sc = b.matmul(qh, kh, transpose_x=True, name="attn_qk")  # [Hkv,G,S,S]
    masked = b.add(sc, mask, name="attn_masked")
    # max-shifted: the chip's own softmax overflows past a score of about 11 (pmetal; apple/coremltools#2726)
    shifted = b.sub(masked, b.reduce_max(masked, axes=[3], name="attn_max"), name="attn_shift")
    pr = b.softmax(shifted, axis=-1, name="attn_p")
    o = b.matmul(vh, pr, transpose_y=True, name="attn_pv")  # [Hkv,1,Dh,S]·[Hkv,G,S,S]ᵀ -> [Hkv,G,Dh,S]
    return b.reshape(o, [1, s.heads * s.head_dim, 1, seq], name="attn")  # -> [1,H·Dh,1,S]
