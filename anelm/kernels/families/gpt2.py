"""The GPT-2 family: LayerNorm with a shift, biases on every linear, GELU (tanh form), learned
positions (added to the embedding on the CPU, so no rotary tables), fused q/k/v (HF's Conv1D
`c_attn`, transposed to `[out, in]` by `models.gpt2.sanitize`), and an attention scale that
the config may turn off or divide by the layer's depth."""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from ...ir.builder import GraphBuilder
from ...ir.graph import Value
from .base import Family

QKV = ("wq", "wk", "wv")  # the training kernels' roles in c_attn's rows, in row order


class GPT2Family(Family):
    layer_norm = True
    rotary = False
    gated = False
    activation = "gelu_tanh"  # on the CPU: the up projection has no gate
    mlp_inputs = ("fc",)
    stream_writers = ("o", "proj")
    slot_roles = MappingProxyType({"qkv": ("qkv",), "o": ("o",), "fc": ("fc",), "proj": ("proj",)})
    part_roles = MappingProxyType({"qkv": QKV, "o": ("wo",), "fc": ("w1",), "proj": ("w2",)})

    def norm_eps(self, config) -> float:
        return config.layer_norm_epsilon

    def score_scale(self, config, index: int) -> float:
        scale = 1.0 / math.sqrt(config.head_dim) if config.scale_attn_weights else 1.0
        return scale / (index + 1) if config.scale_attn_by_inverse_layer_idx else scale

    def linears(self, w: dict[str, np.ndarray], d: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        (wqkv, bqkv) = self.affine(w, "qkv")  # fused rows [q | k | v]
        raw = {n: (wqkv[i * d:(i + 1) * d], bqkv[i * d:(i + 1) * d]) for i, n in enumerate("qkv")}
        raw.update({n: self.affine(w, n) for n in ("o", "fc", "proj")})
        return raw

    def layer_matrix(self, weights: dict[str, np.ndarray], layer: int, role: str) -> np.ndarray:
        """As `Family.layer_matrix`; q, k and v are the row thirds of the fused c_attn."""
        if role not in QKV:
            return super().layer_matrix(weights, layer, role)
        qkv = weights[self.weight_name(layer, "qkv")]
        third = qkv.shape[0] // 3
        return qkv[QKV.index(role) * third:(QKV.index(role) + 1) * third]

    def mlp(self, b: GraphBuilder, h: Value, lin) -> Value:
        """proj(gelu_tanh(fc·h)), GELU as x·sigmoid(2u) (strict rejects `gelu`)."""
        return lin(b.gelu_tanh(lin(h, "fc"), as_sigmoid=True), "proj")


FAMILY = GPT2Family("gpt2")
