"""The prefill kernel of one sequence bucket: a whole decoder layer over positions 0..S-1.

A generation kernel returns more than the next hidden state: it also returns the layer's keys
and values, so that the KV cache can be filled in the `[1, C, 1, S]` layout the decode kernels
read (C = Hkv·Dh channels, HF's head-major order). Several results come back as one
multi-output program (concat is a compile-time reject), declared in alphabetical order (`k`,
`v`, `y`) so that the surfaces bind in that order without renaming. Keys leave the program as
heads `[Hkv, 1, Dh, S]`: the same packed bytes as `[1, C, 1, S]`, one reshape less.
The pieces are the layer library's (`layers.py`).
"""

from __future__ import annotations

import numpy as np

from ..ir.builder import GraphBuilder
from ..ir.graph import Graph
from .attention import causal_mask
from .layers import LayerShape, declare_inputs, full_attention, layer_back, layer_front
from .lora import Slot, slot_input_shapes, slot_values


def prefill_layer(s: LayerShape, p: dict, seq: int, rope: tuple[np.ndarray, np.ndarray] | None = None,
                  name: str = "prefill", kv_outputs: bool = True, lora: tuple[Slot, ...] = ()) -> Graph:
    """One layer over positions 0..seq-1: x `[1, D, 1, seq]` -> k, v `[Hkv, 1, Dh, seq]`
    (the cache's `[1, C, 1, seq]` bytes) and y `[1, D, 1, seq]`; `p` from `layer_params`.

    `rope` = full-width (cos, sin) `[1, 1, Dh, seq]` for positions 0..seq-1 (None for GPT-2),
    baked as consts: prefill always starts at position 0, so one program serves every prompt
    of the bucket. A prompt shorter than `seq` is zero-padded; the causal mask keeps the padding
    (later positions) out of every real position's attention. `kv_outputs=False` returns y only.
    `lora`: the adapter slots (`lora.plan_slots`), whose A and B are inputs beside x.
    """
    b = GraphBuilder(name)
    inputs = declare_inputs(b, {"x": [1, s.d, 1, seq], **slot_input_shapes(lora)})
    x, adapter = inputs["x"], slot_values(inputs, lora)
    tables = None
    if rope is not None:
        tables = (b.const(rope[0], name="rope_cos", dtype="fp16", blob=True),
                  b.const(rope[1], name="rope_sin", dtype="fp16", blob=True))
    qh, kh, vh, k, v = layer_front(b, s, p, x, tables, adapter)
    mask = b.const(causal_mask(seq, window=s.window), name="causal_mask", dtype="fp16", blob=True)  # [1,1,S,S]
    y = layer_back(b, s, p, x, full_attention(b, s, qh, kh, vh, mask), adapter)
    if kv_outputs:
        b.output("k", k)
        b.output("v", v)
    b.output("y", y)
    return b.build()
