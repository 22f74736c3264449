"""Model presets for `anelm train --preset`, as HF `config.json` dicts (docs/training.md).

The stories* shapes are llama2.c's TinyStories models (vocab 32000 Llama-2 SentencePiece,
SwiGLU hidden = 2/3·4·dim rounded up to a multiple of 32, eps 1e-5, shared classifier, and
the context lengths llama2.c trained them with: 256 for 15M, 1024 for 42M and 110M).
`qwen3-0.6b` is the real Qwen3-0.6B config (q/k RMSNorm, θ = 1e6, eps 1e-6, tied), not
maderix's Qwen3-shaped Llama. Semantics are HF's throughout: no residual scaling.
"""

from __future__ import annotations

import copy

from .errors import PresetError

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
          "initializer_range": 0.02, "tie_word_embeddings": True, "torch_dtype": "float32"}


def _stories(dim: int, layers: int, heads: int, hidden: int, ctx: int) -> dict:
    return {**_LLAMA, "vocab_size": 32000, "hidden_size": dim, "intermediate_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "head_dim": dim // heads,
            "max_position_embeddings": ctx, "bos_token_id": 1, "eos_token_id": 2}


PRESETS: dict[str, dict] = {
    # ~1.2 M parameters (131 K of them the tied embedding): small enough that the default run
    # trains on the emulator in minutes on 2 cores. vocab_size is the BPE size trained on the
    # data; the trainer may lower it to what the tokenizer actually produced.
    "tiny": {**_LLAMA, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 512,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
             "head_dim": 32, "max_position_embeddings": 128},
    "stories15m": _stories(288, 6, 6, 768, 256),
    "stories42m": _stories(512, 8, 8, 1376, 1024),
    "stories110m": _stories(768, 12, 12, 2048, 1024),
    "qwen3-0.6b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "attention_bias": False, "tie_word_embeddings": True,
        "initializer_range": 0.02, "use_sliding_window": False, "max_window_layers": 28,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32"},
}

# Suggested training settings per preset (the trainer's defaults; flags override them).
TRAIN_DEFAULTS: dict[str, dict] = {
    # 120 steps: eval loss ~0.8 nats (0.17x the corpus unigram entropy) in ~2.5 min on 2 cores
    "tiny": {"seq_len": 128, "batch_size": 8, "lr": 2e-3, "bpe_vocab_size": 1024, "steps": 120},
    "stories15m": {"seq_len": 256, "batch_size": 4, "lr": 5e-4},
    "stories42m": {"seq_len": 256, "batch_size": 4, "lr": 3e-4},
    "stories110m": {"seq_len": 256, "batch_size": 2, "lr": 3e-4},
    "qwen3-0.6b": {"seq_len": 256, "batch_size": 1, "lr": 1e-4},
}


def get_preset(name: str) -> dict:
    """A fresh copy of the preset's HF config dict; unknown names list the valid ones."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; expected one of: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def hf_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every weight's HF name and shape (PyTorch orientation `[out, in]`) for a Llama or Qwen3
    config dict: the model definition's own list (`anelm.models.<type>.expected_shapes`)."""
    from ..models.config import config_from_dict
    from ..models.registry import architecture

    config = config_from_dict(dict(cfg), "preset")
    return architecture(config.model_type).expected_shapes(config)


def count_params(cfg: dict) -> int:
    """Number of parameters (a tied embedding counted once)."""
    total = 0
    for shape in hf_weight_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
