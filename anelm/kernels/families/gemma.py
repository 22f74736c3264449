"""The Gemma family (Gemma 3): Llama's attention with per-head q/k norms, plus

- a norm on each sub-block's output before the residual add (`attn_post_norm`,
  `mlp_post_norm`), so the post-norms, not the o and down projections, write the stream;
- every norm gain stored as w and applied as 1 + w (`affine` returns the gain itself);
- a gated MLP with GELU's tanh form; scores scaled by `query_pre_attn_scalar`^-0.5.
"""

from __future__ import annotations

import math

import numpy as np

from ...ir.builder import GraphBuilder
from ...ir.graph import Value
from .llama import LlamaFamily


class GemmaFamily(LlamaFamily):
    stream_writers = ()  # the post-norms write the stream; o and down feed them
    post_norms = ("attn_post_norm", "mlp_post_norm")
    activation = "gelu_tanh"
    gain_offset = 1.0

    def score_scale(self, config, index: int) -> float:
        return 1.0 / math.sqrt(config.query_pre_attn_scalar)

    def affine(self, w: dict[str, np.ndarray], role: str) -> tuple[np.ndarray, np.ndarray | None]:
        """As `Family.affine`, with a norm's gain as applied: 1 + w."""
        weight, bias = super().affine(w, role)
        return (weight + np.float32(self.gain_offset), bias) if role.endswith("norm") else (weight, bias)

    def mlp(self, b: GraphBuilder, h: Value, lin) -> Value:
        """down(gelu_tanh(gate·h) ⊙ up·h), GELU as x·sigmoid(2u) (strict rejects `gelu`)."""
        act = b.gelu_tanh(lin(h, "gate"), name="mlp_gelu", as_sigmoid=True)
        return lin(b.mul(act, lin(h, "up"), name="mlp_prod"), "down")


FAMILY = GemmaFamily("gemma")
