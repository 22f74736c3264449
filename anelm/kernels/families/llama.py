"""The Llama family (Llama, Qwen2, Qwen3, Mistral, SmolLM2/3; Phi-3's fused checkpoint split at load): RMSNorm,
RoPE, SwiGLU, separate q/k/v projections (GQA), Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm where present."""

from __future__ import annotations

from types import MappingProxyType

from ...ir.builder import GraphBuilder
from ...ir.graph import Value
from ...models.names import PROJECTIONS
from .base import Family


class LlamaFamily(Family):
    mlp_inputs = ("gate", "up")
    stream_writers = ("o", "down")
    projections = PROJECTIONS["llama"]
    slot_roles = MappingProxyType({"qkv": ("q", "k", "v"), "o": ("o",), "gate": ("gate",), "up": ("up",),
                                   "down": ("down",)})
    part_roles = MappingProxyType({"q": ("wq",), "k": ("wk",), "v": ("wv",), "o": ("wo",), "gate": ("w1",),
                                   "up": ("w3",), "down": ("w2",)})

    def mlp(self, b: GraphBuilder, h: Value, lin) -> Value:
        """SwiGLU: down(silu(gate·h) ⊙ up·h), silu as x·sigmoid(x) (the conservative form every chip takes)."""
        g = lin(h, "gate")
        act = b.mul(g, b.sigmoid(g, name="mlp_sig"), name="mlp_silu")
        return lin(b.mul(act, lin(h, "up"), name="mlp_prod"), "down")


FAMILY = LlamaFamily("llama")
