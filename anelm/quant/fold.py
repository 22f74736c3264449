"""Norm gains folded into the linears that read them: the same model, with unit gains.

    W·(g ⊙ n) = (W·diag g)·n

The kernels fold the gains in anyway (`kernels/prefill.layer_params`), and a fold multiplies
weight *columns*, which would not keep a per-row int8 matrix int8. Folding before quantizing
makes the folder's matrices the ones the kernels run, and leaves the folder an ordinary model
(gains of one) for every reader. Qwen3's q/k norms act after the projections and stay.
"""

from __future__ import annotations

import numpy as np

from ..models.errors import InputError

# HF names inside a Llama/Qwen3 layer: each norm and the linears that read its output
NORM_READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SUPPORTED = ("llama", "qwen3")


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED:
        raise InputError(f"quantize supports {' and '.join(SUPPORTED)} models for now; "
                         f"got model_type {config.model_type!r}")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def fold_norms(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of `weights` with every layer's norm gains moved into the linears after them."""
    check_supported(config)
    out = dict(weights)
    for i in range(config.num_hidden_layers):
        p = layer_prefix(i)
        for norm, readers in NORM_READERS.items():
            g = out[p + norm + ".weight"]
            for r in readers:
                out[p + r + ".weight"] = (out[p + r + ".weight"] * g[None, :]).astype(np.float32)
            out[p + norm + ".weight"] = np.ones_like(g)
    return out
