"""SmolLM3: Llama's layers where RoPE is switched off on every fourth one (`no_rope_layers[i]`
is 1 where layer i rotates q and k, 0 where it does not: NoPE), a tied head, and HF's optional
sliding window on the NoPE layers (`use_sliding_window`). A NoPE layer's RoPE is the `none`
type of `rope.py`: every frequency 0, so cos 1 and sin 0, the identity wherever tables are
applied (the CPU reference, the device, the training step).

Weights use HF's `SmolLM3ForCausalLM` names. llama.cpp converts SmolLM3 as Llama (q/k rows
permuted, `gguf_weights`) under its own architecture name, and keeps the NoPE interval of 4 as
a constant rather than in the metadata: HF's default, too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from . import llama
from .config import LlamaConfig, layer_window, set_layer_types
from .rope import NOPE

ARCH = replace(llama.ARCH, model_type="smollm3", gguf_arch="smollm3")


@dataclass(frozen=True)
class Config(LlamaConfig):
    model_type: ClassVar[str] = "smollm3"
    architecture: ClassVar[str] = "SmolLM3ForCausalLM"
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    rope_theta: float = 2_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    pad_token_id: int | None = 128004  # HF's default is an id of the real vocabulary: kept, for export
    no_rope_layers: tuple[int, ...] | None = None  # None: 0 on every `no_rope_layer_interval`-th layer
    no_rope_layer_interval: int = 4
    use_sliding_window: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # None: sliding on the NoPE layers when windowed

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        d = dict(d)
        for k in ("no_rope_layers", "layer_types"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return super().from_dict(d)

    def __post_init__(self):
        super().__post_init__()
        n, every = self.num_hidden_layers, self.no_rope_layer_interval
        if self.no_rope_layers is None:
            self._require_positive("no_rope_layer_interval")
            self._set("no_rope_layers", tuple(int((i + 1) % every != 0) for i in range(n)))
        if len(self.no_rope_layers) != n or not set(self.no_rope_layers) <= {0, 1}:
            raise self._fail(f"no_rope_layers must be 0 or 1 for each of {n} layers, got {list(self.no_rope_layers)}")
        set_layer_types(self, lambda i: not self.no_rope_layers[i])

    def rope(self, index: int) -> tuple[float, dict | None]:
        """(RoPE base, scaling) of layer `index`: NoPE's identity where it has no RoPE."""
        return (self.rope_theta, self.rope_scaling) if self.no_rope_layers[index] else (self.rope_theta, NOPE)

    window = layer_window

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "no_rope_layers": list(self.no_rope_layers), "layer_types": list(self.layer_types)}


expected_shapes = llama.expected_shapes
sanitize, unsanitize, gguf_weights = llama.sanitize, llama.unsanitize, llama.gguf_weights


class Model(llama.Model):
    """Llama's reference, which takes each layer's RoPE tables (`config.rope`) and window."""


def build(config: Config, weights: dict[str, np.ndarray]) -> Model:
    return Model(config, weights)
