"""The architectures anelm runs: each is one module of `anelm.models`, named by its HF
`model_type`, that declares what the architecture is.

A module exports `ARCH` (an `Architecture`: its HF module and weight names by role, its layer
family, its GGUF name, its LoRA defaults), `Config`, the CPU reference `Model`,
`expected_shapes`, `sanitize`/`unsanitize` (HF checkpoint <-> ours), and where they differ
from Llama's, `gguf_config` (its GGUF metadata) and `gguf_weights` (what llama.cpp's converter
changed). Adding an architecture is a module here, its name in MODEL_TYPES, and its family in
`kernels/families` if it shares none. Code that needs to know an architecture asks here (or
`names.py`, which reads these declarations by role), never branches on a model type.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType, ModuleType
from typing import Any, Mapping

from .errors import ConfigError

MODEL_TYPES = ("gpt2", "llama", "qwen3", "gemma3_text", "qwen2", "mistral", "smollm3", "phi3")


@dataclass(frozen=True)
class Architecture:
    model_type: str                  # HF's `model_type`, the module's name
    family: str                      # the layer layout it shares (`kernels/families`)
    gguf_arch: str                   # llama.cpp's `general.architecture`
    layer_prefix: str                # the HF prefix of layer {}'s weights
    modules: Mapping[str, str]       # role -> HF module path inside a layer (`names.py` lists the roles)
    ends: Mapping[str, str]          # embed, final_norm, head (positions): weights outside the layers
    # the projections (roles) LoRA may target, in data-flow order; a LoRA target is the last
    # part of the HF module path ("q_proj", "c_attn"), and GPT-2's "c_proj" names two roles
    projections: tuple[str, ...]
    default_targets: tuple[str, ...]  # `finetune`'s LoRA targets when none are given
    base_prefix: str = "model."      # the bare base model's path inside the LM (GPT-2: "transformer.")
    conv1d: bool = False             # HF stores the linears as Conv1D [in, out] (PEFT's fan_in_fan_out)
    aliases: tuple[str, ...] = ()    # other HF model_types read as this one (a multimodal folder's text)
    # HF module path -> the roles whose rows it stacks, in order, where the checkpoint fuses
    # projections that anelm keeps apart (Phi-3's qkv_proj, gate_up_proj): LoRA targets those
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("modules", "ends", "fused"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


LLAMA_MODULES = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                 "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
LLAMA_ENDS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "head": "lm_head.weight"}
LLAMA_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@cache
def module(model_type: str) -> ModuleType:
    return importlib.import_module(f"anelm.models.{model_type}")


def arch(model_type: str) -> Architecture:
    """The declaration of `model_type` (KeyError for one anelm does not run)."""
    if model_type not in MODEL_TYPES:
        raise KeyError(model_type)
    return module(model_type).ARCH


def resolve(model_type: object) -> str | None:
    """The architecture that reads HF `model_type` (itself, or the one it is an alias of)."""
    return next((t for t in MODEL_TYPES if model_type == t or model_type in arch(t).aliases), None)


def config_class(model_type: Any, source: str = "config") -> type:
    """The config class of HF `model_type` (its architecture's)."""
    found = resolve(model_type)
    if found is None:
        raise ConfigError(f"unsupported model_type {model_type!r} in {source}: "
                          f"expected one of {', '.join(sorted(MODEL_TYPES))}")
    return module(found).Config


def architecture(model_type: str) -> ModuleType:
    """The module that implements `model_type`: exports Config, Model, sanitize, expected_shapes."""
    config_class(model_type)  # one-line error for a type we do not support
    return module(model_type)


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` names anelm reads."""
    return tuple(dict.fromkeys(arch(t).gguf_arch for t in MODEL_TYPES))


def model_type_of_gguf(name: object, meta: Mapping | None = None) -> str | None:
    """The model type of a GGUF `general.architecture` name, or None when anelm has none. Where
    architectures share a name (llama.cpp writes Mistral as `llama`), the one whose module's
    `gguf_claims(meta)` holds, else the one that claims nothing."""
    found = [t for t in MODEL_TYPES if arch(t).gguf_arch == name]
    claimed = [t for t in found if meta is not None and getattr(module(t), "gguf_claims", lambda m: False)(meta)]
    return next(iter(claimed or [t for t in found if not hasattr(module(t), "gguf_claims")]), None)


class ByType(Mapping):
    """model_type -> one field of its declaration, as a read-only mapping over MODEL_TYPES."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, model_type: str):
        return getattr(arch(model_type), self.name)

    def __iter__(self):
        return iter(MODEL_TYPES)

    def __len__(self) -> int:
        return len(MODEL_TYPES)
