"""Where a run's first weights come from: a seeded random init, or a pretrained HF folder.

Random init follows llama2.c's `_init_weights` (itself GPT-2's): every matrix and the
embedding N(0, 0.02), the projections that write into the residual stream (attention output
and MLP down) N(0, 0.02/√(2L)) so the residual's variance does not grow with depth, norm
scales 1. llama2.c scales `w3` (the MLP *up* projection) by mistake; we scale `down_proj`,
the residual one, as GPT-2 intends. The generator is numpy's PCG64 seeded with `--seed`, and
tensors are drawn in the model's data-flow order, so a seed names one initial model.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..kernels.families import family_for
from ..models.names import layer_modules
from ..models.registry import MODEL_TYPES
from .errors import TrainError

# what the device training steps implement (`steps.py`: a step per family that trains)
TRAINABLE_TYPES = tuple(t for t in MODEL_TYPES if family_for(t).trains)


def model_config(cfg: dict):
    """The `anelm.models` config dataclass for an HF config dict, checked trainable."""
    from ..models.config import config_from_dict

    config = config_from_dict(cfg, "model config")
    if not family_for(config.model_type).trains:  # every family's layers have a step today (`steps.py`)
        raise TrainError(f"cannot train model_type {config.model_type!r}: expected one of "
                         f"{', '.join(TRAINABLE_TYPES)}")
    if getattr(config, "mlp_bias", False):
        raise TrainError("cannot train a model with MLP biases: expected mlp_bias = false")
    return config


def weight_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every weight, in data-flow order (the architecture's own list)."""
    from ..models.registry import architecture

    return architecture(config.model_type).expected_shapes(config)


def init_weights(config, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """Fresh float32, C-contiguous master weights (AdamW requires both)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    residual_std = std / math.sqrt(2 * config.num_hidden_layers)
    modules = layer_modules(config.model_type)
    residual = tuple(f"{modules[r]}.weight" for r in family_for(config.model_type).stream_writers)
    out = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:  # norm scales (input, post-attention, final, q/k norms) and biases
            # a gain of one: w = 1, or w = 0 where the gain is 1 + w (Gemma)
            one = 1.0 - family_for(config.model_type).gain_offset
            out[name] = np.zeros(shape, np.float32) if name.endswith(".bias") else np.full(shape, one, np.float32)
            continue
        s = residual_std if name.endswith(residual) else std
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(s))
    return out


def load_pretrained(hf_dir: str | Path):
    """(config dict with HF names, float32 weights, tokenizer or None) from an HF folder or GGUF,
    for `--init-from`: fine-tuning starts from these weights instead of random ones."""
    from ..models.loading import load_model
    from ..models.formats.quantized import refuse_quantized

    p = Path(hf_dir)
    if not (p.is_dir() or (p.is_file() and p.suffix == ".gguf")):
        raise TrainError(f"--init-from {p}: expected an HF model folder (config.json + "
                         "model.safetensors) or a .gguf file, got " + ("a file" if p.exists() else "nothing"))
    refuse_quantized(p, "train --init-from")
    config, weights, tok = load_model(p)
    model_config(config.to_dict())  # refuses architectures the trainer cannot run
    weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    return config.to_dict(), weights, tok
