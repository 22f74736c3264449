"""Whole decoder layers as graphs (weights baked as BLOBFILE consts), for inspection and demos.

A layer here is the prefill kernel of the generation pipeline (`prefill.py`) without its
cache outputs, so the layer `anelm compile` writes is the one `anelm generate` runs.
Weights are numpy float32 arrays keyed by the HF names inside one layer
(`anelm.models.names.layer_weights`; random ones from `names.random_layer`), in `[out, in]`
orientation (GPT-2's Conv1D weights transposed, as `anelm.models.gpt2.sanitize` leaves them).
"""

from __future__ import annotations

import numpy as np

from ..ir.graph import Graph
from ..models.layers import rope_inv_freq, rope_tables
from .layers import layer_params, layer_shape, rope_full_tables
from .prefill import prefill_layer


def decoder_layer(config, w: dict[str, np.ndarray], seq: int, index: int = 0, name: str = "layer") -> Graph:
    """Layer `index` of a GPT-2 / Llama / Qwen3 config: x `[1, D, 1, S]` -> y, causal over S positions."""
    s = layer_shape(config, index)
    rope = None
    if s.family.rotary:
        inv = rope_inv_freq(config.head_dim, *config.rope(index))
        rope = rope_full_tables(*rope_tables(np.arange(seq), inv))  # positions 0..S-1
    # the weights fold straight to fp16, the dtype their blobs hold: no float32 copy of the layer
    return prefill_layer(s, layer_params(s, w, half=True), seq, rope, name=name, kv_outputs=False)

