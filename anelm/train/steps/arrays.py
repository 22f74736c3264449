"""Arrays at the training step's edges: the caller's weights checked against the config, a
sequence's columns padded to a kernel's width."""

from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ..presets import hf_weight_shapes

F32 = np.float32


def padded(a: np.ndarray, width: int) -> np.ndarray:
    """[C, S] -> [C, width], zeros after the S columns."""
    out = np.zeros((a.shape[0], width), F32)
    out[:, :a.shape[1]] = a
    return out


def check_weights(cfg, weights: dict) -> dict[str, np.ndarray]:
    want = hf_weight_shapes(cfg.to_dict())
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise ShapeError(f"weights: expected the {len(want)} HF names of this config; "
                         f"missing {missing[:4]}, unexpected {extra[:4]}")
    out = {}
    for name, shape in want.items():
        w = np.asarray(weights[name], dtype=F32)
        if w.shape != shape:
            raise ShapeError(f"weight {name}: expected shape {list(shape)}, got {list(w.shape)}")
        out[name] = w
    return out
