"""The answers a family gives the layer library (`families/__init__.py`), with the common ones."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from ...ir.builder import GraphBuilder
from ...ir.graph import Value
from ...models.names import family_members, family_modules, weight_name


@dataclass(frozen=True, repr=False)
class Family(ABC):
    """The common answers; a family module subclasses it with its own (module doc)."""

    name: str  # the family in anelm.models.names ("gpt2", "llama")

    layer_norm: ClassVar[bool] = False  # LayerNorm (centred, with a shift); else RMSNorm
    rotary: ClassVar[bool] = True       # RoPE on q and k; else learned positions (on the CPU)
    gated: ClassVar[bool] = True        # SwiGLU's gate and up projections; else one up projection
    activation: ClassVar[str] = "silu"  # the MLP's activation ("silu", "gelu_tanh"), as the training kernels take it
    gain_offset: ClassVar[float] = 0.0  # a norm's gain is offset + w (Gemma stores w, applies 1 + w)
    trains: ClassVar[bool] = True       # the training steps (`anelm.train`) implement this family
    mlp_inputs: ClassVar[tuple[str, ...]] = ()      # the kernel projections reading the MLP norm
    stream_writers: ClassVar[tuple[str, ...]] = ()  # ... and those writing into the residual stream
    post_norms: ClassVar[tuple[str, ...]] = ()      # norms of the attention's and MLP's outputs (Gemma)
    projections: ClassVar[tuple[str, ...]] = ()     # the layer's linears by role (`linears`)
    slot_roles: ClassVar[MappingProxyType] = MappingProxyType({})  # kernel projection -> its roles, in row order
    part_roles: ClassVar[MappingProxyType] = MappingProxyType({})  # layer part -> training kernel roles in it

    def __repr__(self) -> str:
        return f"<{self.name} family>"

    @cached_property
    def modules(self) -> dict[str, str]:
        """role -> HF module path inside a layer, for every member of the family."""
        return family_modules(self.name)

    # --- the config ---------------------------------------------------------------------------
    def norm_eps(self, config) -> float:
        return config.rms_norm_eps

    def attention_scale(self, config, index: int) -> float:
        """The scores' scale in layer `index`: the family's, times the square of RoPE's attention
        factor (YaRN's gain on cos and sin, which q and k both carry: `models/rope.py`)."""
        gain = config.attention_factor(index) if self.rotary else 1.0
        return self.score_scale(config, index) * gain * gain

    def score_scale(self, config, index: int) -> float:
        return 1.0 / math.sqrt(config.head_dim)

    # --- a layer's parameters (HF names inside the layer, `[out, in]`) --------------------------
    def affine(self, w: dict[str, np.ndarray], role: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(weight, bias or None) of the layer part `role`: a linear's, or a norm's gain and shift."""
        m = self.modules[role]
        return w[m + ".weight"], w.get(m + ".bias")

    def linears(self, w: dict[str, np.ndarray], d: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        """{kernel projection: (W, bias or None)} before any folding, q, k and v apart."""
        return {role: self.affine(w, role) for role in self.projections}

    def head_norms(self, w: dict[str, np.ndarray]) -> bool:
        """Whether the layer normalises q and k per head (Qwen3's q_norm, k_norm)."""
        return "q_norm" in self.modules and self.modules["q_norm"] + ".weight" in w

    def reads_norm(self, projection: str) -> str | None:
        """The norm (role) whose output the kernel projection reads, if any."""
        return "attn_norm" if projection == "qkv" else "mlp_norm" if projection in self.mlp_inputs else None

    def layer_matrix(self, weights: dict[str, np.ndarray], layer: int, role: str) -> np.ndarray:
        """W `[out, in]` of a training kernel's weight role (`wq`, `w1`...) in layer `layer`
        (full HF names in `weights`)."""
        part = {r: p for p, roles in self.part_roles.items() for r in roles}[role]
        return weights[self.weight_name(layer, part)]

    def weight_name(self, layer: int, role: str) -> str:
        """The full HF name of a layer part's weight: the family's members share their names
        for the parts a kernel stages (the family's name need not be a model type: Gemma's)."""
        return weight_name(family_members(self.name)[0], layer, role)

    # --- the graph ----------------------------------------------------------------------------
    @abstractmethod
    def mlp(self, b: GraphBuilder, h: Value, lin) -> Value:
        """The MLP of the normalised stream h; `lin(x, projection)` is the library's projection
        (with its LoRA term), so a family writes only its activation."""
