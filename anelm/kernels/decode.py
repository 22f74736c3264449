"""The decode kernel: one token through one decoder layer, reading that layer's KV cache.

Inputs (declared in alphabetical order, the order surfaces bind in, so they bind as declared),
W columns wide (`columns`: 16 under `strict`, whose I/O widths are multiples of 16; the token
is in column 0 and the other columns are zeros, as Orion decodes):

    cos, sin  [1, 1, Dh, W]   RoPE of each column's position (Llama/Qwen3 only: they change per step)
    k_cache   [Hkv, 1, Dh, T] the layer's keys at positions 0..T-1 (post-RoPE), as the cache stores them
    mask      [1, 1, T, W]    additive, per column: 0 where a position holds a token before the
                              column's own, −1e4 elsewhere
    v_cache   [Hkv, 1, Dh, T]
    x         [1, D, 1, W]    the tokens' hidden states

The caches are declared with their heads split: the same packed bytes as the `[1, C, 1, T]`
layout (C = Hkv·Dh, head-major), without a reshape op that would pass over the whole cache.
Outputs: k_new and v_new `[Hkv, 1, Dh, W]` (column 0 is what the host appends at the token's
position) and y `[1, D, 1, W]`. The cache and the position are inputs, not consts, so one program per layer
serves every step (the compile budget is 115 per process). The declared tensors are smaller
than the 49,152-byte minimum surface: the runtime pads the allocation.

The token attends to the cache and to itself. Its own key is not in the cache yet (the host
appends it from k_new afterwards), so the softmax runs over two parts without joining them
(concat is a compile-time reject), with one shared maximum:

    m = max(max_t s_t, s_new),  p_t = e^(s_t − m) / Z,  p_new = e^(s_new − m) / Z
    Z = Σ_t e^(s_t − m) + e^(s_new − m),  out = Σ_t p_t·v_t + p_new·v_new

No op mixes columns: the scores are `[Hkv, G, T, W]` (cache positions down, columns across),
s_new is each column's own q·k, and every reduction runs over positions or channels. So each
column is a token of its own, padding cannot reach column 0, and the emulator evaluates only
the column the host reads (device/emulator/columns.py).

Several tokens at once (a chunk of up to W, `decode_mask(tokens=k)`): column j is the token at
position length + j, which must also see the chunk's tokens before it. Their keys are no
column's input, so the host runs the program twice: the first pass's k_new and v_new (a layer's
keys and values depend on its input alone, not on attention) go into the cache, and the second
pass, each column's mask hiding the positions from its own on, gives y. Two passes of one
program serve up to W tokens where decoding them took W passes, and nothing new is compiled.
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
    """W queries (pre-scaled), each over the cache plus its own key; qh `[Hkv,G,Dh,W]`, kh/vh
    `[Hkv,1,Dh,W]`, caches kc/vc `[Hkv,1,Dh,T]`, mask `[1,1,T,W]`. Returns `[1, H·Dh, 1, W]`."""
    width = qh.shape[3]
    sc = b.matmul(kc, qh, transpose_x=True, name="attn_qk")  # [Hkv,1,T,Dh]·[Hkv,G,Dh,W] -> [Hkv,G,T,W]
    sc = b.add(sc, mask, name="attn_masked")  # positions down the rows, each column its own
    sn = b.reduce_sum(b.mul(qh, kh, name="attn_qk_new"), axes=[2], name="attn_new")  # [Hkv,G,1,W]
    m = b.maximum(b.reduce_max(sc, axes=[2], name="attn_max_cache"), sn, name="attn_max")
    ec = b.exp(b.sub(sc, m, name="attn_shift"), name="attn_e")  # [Hkv,G,T,W]
    en = b.exp(b.sub(sn, m, name="attn_shift_new"), name="attn_e_new")  # [Hkv,G,1,W]
    z = b.add(b.reduce_sum(ec, axes=[2], name="attn_sum_cache"), en, name="attn_z")
    past = b.matmul(vc, ec, name="attn_pv")  # [Hkv,1,Dh,T]·[Hkv,G,T,W] -> [Hkv,G,Dh,W]
    num = b.add(past, b.mul(vh, en, name="attn_pv_new"), name="attn_num")
    o = b.real_div(num, z, name="attn_out")
    return b.reshape(o, [1, s.heads * s.head_dim, 1, width], name="attn")  # [Hkv,G,Dh,W] -> [1,H·Dh,1,W]


def decode_layer(s: LayerShape, p: dict, capacity: int, rope: bool, name: str = "decode",
                 columns: int = 1, lora: tuple[Slot, ...] = ()) -> Graph:
    """One layer for one token (in column 0 of `columns`) over a cache of `capacity` positions
    (see the module doc); `p` from `layer_params`; `lora`: the adapter slots, whose A and B are
    inputs too."""
    b = GraphBuilder(name)
    heads = [s.kv_heads, 1, s.head_dim, capacity]
    shapes = {"k_cache": heads, "mask": [1, 1, capacity, columns], "v_cache": heads, "x": [1, s.d, 1, columns],
              **slot_input_shapes(lora)}
    if rope:
        shapes.update(cos=[1, 1, s.head_dim, columns], sin=[1, 1, s.head_dim, columns])
    i = declare_inputs(b, shapes)
    x, adapter = i["x"], slot_values(i, lora)
    qh, kh, vh, k, v = layer_front(b, s, p, x, (i["cos"], i["sin"]) if rope else None, adapter)
    y = layer_back(b, s, p, x, cached_attention(b, s, qh, kh, vh, i["k_cache"], i["v_cache"], i["mask"]),
                   adapter)
    b.output("k_new", k)
    b.output("v_new", v)
    b.output("y", y)
    return b.build()


def decode_mask(length: int, capacity: int, window: int | None = None, ring: int | None = None,
                columns: int = 1, tokens: int = 1) -> np.ndarray:
    """[1, 1, capacity, columns]: column j < `tokens` is the token at position length + j and
    sees the positions before it (the chunk's earlier tokens too: the module doc); with a
    sliding `window`, only the window − 1 positions before it. `ring`: the cache holds position
    p in column p mod ring (`DeviceCache`), so the columns seen are those of the positions seen.
    Padding columns repeat the last token's."""
    m = np.full((1, 1, capacity, columns), MASK_VALUE, np.float16)
    for j in range(columns):
        p = length + min(j, tokens - 1)
        seen = np.arange(max(0, p - window + 1) if window else 0, p)
        m[0, 0, seen if ring is None else seen % ring, j] = 0.0
    return m
