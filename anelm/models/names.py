"""HF module and weight names, per architecture family: the one place outside the CPU
references (`gpt2.py`, `llama.py`, `qwen3.py`) that spells them.

Everything else (the device kernels, the training step, the exporters, LoRA's PEFT keys)
names a layer's parts by *role* and asks here for the HF spelling:

    layer_modules("llama")["q"]         -> "self_attn.q_proj"
    weight_name("gpt2", 3, "qkv")       -> "transformer.h.3.attn.c_attn.weight"
    layer_weights(config, weights, 3)   -> layer 3's weights keyed by the names inside the layer
    target_roles("gpt2", "c_proj")      -> ("o", "proj")   (LoRA targets, `adapters.py`)
    model_weight("llama", "embed")      -> "model.embed_tokens.weight"

Roles: `attn_norm`, `mlp_norm` (the two norms of the stream), `attn_post_norm`,
`mlp_post_norm` (Gemma's norms of the attention's and MLP's outputs), `q`, `k`, `v`, `o` (attention
projections; GPT-2 fuses q, k, v into `qkv`), `q_norm`, `k_norm` (Qwen3's and Gemma's per-head norms),
`gate`, `up`, `down` (SwiGLU) or `fc`, `proj` (GPT-2's MLP). Outside the layers: `embed` (the
token embedding), `positions` (GPT-2's learned positions), `final_norm`, `head` (the output
projection; absent when tied, the embedding serves).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import registry
from .registry import ByType

# The tables by model type, read from each architecture's declaration (`registry.py`)
MODULES = ByType("modules")
LAYER_PREFIX = ByType("layer_prefix")
PROJECTIONS = ByType("projections")
DEFAULT_TARGETS = ByType("default_targets")
MODEL_WEIGHTS = ByType("ends")
FAMILY = ByType("family")  # model_type -> the layer layout it shares


def family(model_type: str) -> str:
    """The layer layout `model_type` shares ("llama" for Llama and Qwen3, "gpt2")."""
    return FAMILY[model_type]


def family_members(name: str) -> tuple[str, ...]:
    """The model types whose layers have the layout of family `name`."""
    return tuple(t for t, f in FAMILY.items() if f == name)


def family_modules(name: str) -> dict[str, str]:
    """role -> HF module path inside a layer, for every member of family `name` (Llama's
    roles and Qwen3's q/k norms)."""
    return {r: m for t in family_members(name) for r, m in MODULES[t].items()}


def model_weight(model_type: str, role: str) -> str:
    """The HF name of a weight outside the layers: `embed`, `positions`, `final_norm`, `head`."""
    return MODEL_WEIGHTS[model_type][role]


def has_head_norms(model_type: str) -> bool:
    """Whether attention normalises q and k per head (Qwen3's q_norm, k_norm)."""
    return model_type in MODULES and "q_norm" in MODULES[model_type]


def layer_modules(model_type: str) -> dict[str, str]:
    """role -> HF module path inside one layer."""
    return MODULES[model_type]


def layer_prefix(model_type: str, layer: int) -> str:
    """The HF prefix of layer `layer`'s weights, with its trailing dot."""
    return LAYER_PREFIX[model_type].format(layer)


def weight_name(model_type: str, layer: int, role: str, kind: str = "weight") -> str:
    """The full HF name of a layer part's `weight` (or `bias`)."""
    return f"{layer_prefix(model_type, layer)}{MODULES[model_type][role]}.{kind}"


def module_name(model_type: str, layer: int, role: str) -> str:
    """The full HF module path of a layer part, without `.weight` ("model.layers.3.self_attn.q_proj")."""
    return f"{layer_prefix(model_type, layer)}{MODULES[model_type][role]}"


def lora_module(model_type: str, role: str) -> str:
    """The HF module path inside a layer that a LoRA adapter on projection `role` sits on: the
    checkpoint's fused module where it stacks the role with others (Phi-3's qkv_proj), else the role's own."""
    fused = registry.arch(model_type).fused
    return next((m for m, roles in fused.items() if role in roles), MODULES[model_type][role])


def target_names(model_type: str) -> tuple[str, ...]:
    """The LoRA target module names of an architecture, as PEFT's `target_modules` spells them."""
    return tuple(dict.fromkeys(lora_module(model_type, r).rsplit(".", 1)[-1] for r in PROJECTIONS[model_type]))


def target_roles(model_type: str, target: str) -> tuple[str, ...]:
    """The roles one LoRA target name covers: ("q",) for "q_proj", ("o", "proj") for GPT-2's
    "c_proj", ("q", "k", "v") for Phi-3's "qkv_proj"."""
    return tuple(r for r in PROJECTIONS[model_type] if lora_module(model_type, r).rsplit(".", 1)[-1] == target)


def layer_weights(config: Any, weights: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """Layer `layer`'s weights keyed by the HF names inside the layer (`self_attn.q_proj.weight`...)."""
    prefix = layer_prefix(config.model_type, layer)
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def random_layer(config: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for one layer of `config` (names inside the layer, `[out, in]`),
    scaled like a trained model's: what `anelm compile`, the demo and the benchmarks build."""
    rng = np.random.default_rng(seed)
    d, f = config.hidden_size, config.intermediate_size

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def vec(n, base=0.0):
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    if config.model_type == "gpt2":  # LayerNorms with shifts, a bias on every linear, fused q/k/v
        return {"ln_1.weight": vec(d, 1.0), "ln_1.bias": vec(d), "attn.c_attn.weight": lin(3 * d, d),
                "attn.c_attn.bias": vec(3 * d), "attn.c_proj.weight": lin(d, d), "attn.c_proj.bias": vec(d),
                "ln_2.weight": vec(d, 1.0), "ln_2.bias": vec(d), "mlp.c_fc.weight": lin(f, d),
                "mlp.c_fc.bias": vec(f), "mlp.c_proj.weight": lin(d, f), "mlp.c_proj.bias": vec(d)}
    q, kv, hd = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, config.head_dim
    shapes = {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "gate": (f, d), "up": (f, d), "down": (d, f)}
    w = {}
    for role, module in MODULES[config.model_type].items():  # the layer's norms, by role, and its linears
        w[module + ".weight"] = lin(*shapes[role]) if role in shapes else \
            vec(hd if role in ("q_norm", "k_norm") else d, 1.0)
    return w
