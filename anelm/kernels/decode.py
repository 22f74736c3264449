"""The decode kernel: one token through one decoder layer, reading that layer's KV cache.

Inputs (declared in alphabetical order, so they bind as declared, strict §2.2):

    cos, sin  [1, 1, Dh, 1]   RoPE of the token's position (Llama/Qwen3 only: they change per step)
    k_cache   [Hkv, 1, Dh, T] the layer's keys at positions 0..T-1 (post-RoPE), as the cache stores them
    mask      [1, 1, 1, T]    additive: 0 where a position holds a past token, −1e4 elsewhere
    v_cache   [Hkv, 1, Dh, T]
    x         [1, D, 1, 1]    the token's hidden state

The caches are declared with their heads split: the same packed bytes as the `[1, C, 1, T]`
layout (C = Hkv·Dh, head-major), without a reshape op that would pass over the whole cache.
Outputs: k_new and v_new `[Hkv, 1, Dh, 1]` (the column the host appends at the token's
position) and y `[1, D, 1, 1]`. The cache and the position are inputs, not consts, so one program per layer
serves every step (the compile budget is 115 per process). The declared tensors are smaller
than the 49,152-byte minimum surface: the runtime pads the allocation (strict §2.4), so the
token needs no dummy columns.

The token attends to the cache and to itself. Its own key is not in the cache yet (the host
appends it from k_new afterwards), so the softmax runs over two parts without joining them
(no concat, strict §2.1), with one shared maximum:

    m = max(max_t s_t, s_new),  p_t = e^(s_t − m) / Z,  p_new = e^(s_new − m) / Z
    Z = Σ_t e^(s_t − m) + e^(s_new − m),  out = Σ_t p_t·v_t + p_new·v_new
"""

from __future__ import annotations

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Graph, Value
from .attention import MASK_VALUE
from .layers import LayerShape, declare_inputs, layer_back, layer_front
from .lora import Slot, slot_input_shapes, slot_values


def cached_attention(b: GraphBuilder, s: LayerShape, qh: Value, kh: Value, vh: Value,
                     kc: Value, vc: Value, mask: Value) -> Value:
    """One query (pre-scaled) over the cache plus itself; qh `[Hkv,G,Dh,1]`, kh/vh
    `[Hkv,1,Dh,1]`, caches kc/vc `[Hkv,1,Dh,T]`, mask `[1,1,1,T]`. Returns `[1, H·Dh, 1, 1]`."""
    sc = b.add(b.matmul(qh, kc, transpose_x=True, name="attn_qk"), mask, name="attn_masked")  # [Hkv,G,1,T]
    sn = b.matmul(qh, kh, transpose_x=True, name="attn_new")  # [Hkv,G,1,1]
    m = b.maximum(b.reduce_max(sc, axes=[3], name="attn_max_cache"), sn, name="attn_max")
    ec = b.exp(b.sub(sc, m, name="attn_shift"), name="attn_e")  # [Hkv,G,1,T]
    en = b.exp(b.sub(sn, m, name="attn_shift_new"), name="attn_e_new")  # [Hkv,G,1,1]
    z = b.add(b.reduce_sum(ec, axes=[3], name="attn_sum_cache"), en, name="attn_z")
    past = b.matmul(vc, ec, transpose_y=True, name="attn_pv")  # [Hkv,1,Dh,T]·[Hkv,G,1,T]ᵀ -> [Hkv,G,Dh,1]
    num = b.add(past, b.mul(vh, en, name="attn_pv_new"), name="attn_num")
    o = b.real_div(num, z, name="attn_out")
    return b.reshape(o, [1, s.heads * s.head_dim, 1, 1], name="attn")  # [Hkv,G,Dh,1] -> [1,H·Dh,1,1]


def decode_layer(s: LayerShape, p: dict, capacity: int, rope: bool, name: str = "decode",
                 lora: tuple[Slot, ...] = ()) -> Graph:
    """One layer for one token over a cache of `capacity` positions (see the module doc);
    `p` from `layer_params`; `lora`: the adapter slots, whose A and B are inputs too."""
    b = GraphBuilder(name)
    heads = [s.kv_heads, 1, s.head_dim, capacity]
    shapes = {"k_cache": heads, "mask": [1, 1, 1, capacity], "v_cache": heads, "x": [1, s.d, 1, 1],
              **slot_input_shapes(lora)}
    if rope:
        shapes.update(cos=[1, 1, s.head_dim, 1], sin=[1, 1, s.head_dim, 1])
    i = declare_inputs(b, shapes)
    x, adapter = i["x"], slot_values(i, lora)
    qh, kh, vh, k, v = layer_front(b, s, p, x, (i["cos"], i["sin"]) if rope else None, adapter)
    y = layer_back(b, s, p, x, cached_attention(b, s, qh, kh, vh, i["k_cache"], i["v_cache"], i["mask"]),
                   adapter)
    b.output("k_new", k)
    b.output("v_new", v)
    b.output("y", y)
    return b.build()


def decode_mask(length: int, capacity: int) -> np.ndarray:
    """[1, 1, 1, capacity]: positions below `length` hold past tokens, the rest are hidden."""
    m = np.full((1, 1, 1, capacity), MASK_VALUE, np.float16)
    m[..., :length] = 0.0
    return m
