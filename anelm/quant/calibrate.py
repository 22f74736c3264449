"""Activation ranges at every linear's input, from the CPU reference on calibration text.

The CPU model's `project(i, name, x)` is every projection's one entry point, so wrapping it
on an instance sees each linear's input x [T, in] as the int8 kernels see it (after the norm
gain; without GPT-2's LayerNorm shift, which the kernels fold into the bias: `kernels/int8.py`): per
input channel the largest |x|, and, for W8, per output row the largest unscaled int8 sum
|x·qᵀ| the accumulator will hold.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from ..kernels.families import family_for
from ..models.loading import build_model
from ..models.names import layer_prefix, layer_weights, module_name


def norm_shifts(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{HF linear: the norm shift s its CPU input carries and its int8 input does not}: LayerNorm's
    (GPT-2), which the kernels fold into the bias (`kernels/int8.py`); RMSNorm has none."""
    f, out = family_for(config.model_type), {}
    for i in range(config.num_hidden_layers):
        layer = layer_weights(config, weights, i)
        for key, roles in f.slot_roles.items():
            norm = f.reads_norm(key)
            shift = None if norm is None else f.affine(layer, norm)[1]
            if shift is not None:
                out.update({module_name(config.model_type, i, r): np.asarray(shift, np.float32) for r in roles})
    return out


def calibrate(config, weights: dict[str, np.ndarray], ids: Sequence[int], seq_len: int,
              ints: dict[str, np.ndarray] | None = None, progress: bool | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """({linear: channel max|x| [in]}, {linear: max unscaled sum}) over windows of `ids`.

    Linears have their HF names (models.quantized.linear_names); `ints` gives the int8 matrices whose sums
    are measured (none: only the channel ranges)."""
    from tqdm import tqdm

    model = build_model(config, weights)
    chan: dict[str, np.ndarray] = {}
    sums: dict[str, float] = {}
    plain, shifts = model.project, norm_shifts(config, weights)

    def project(i: int, name: str, x: np.ndarray) -> np.ndarray:
        key = layer_prefix(config.model_type, i) + name
        seen = x - shifts[key] if key in shifts else x
        m = np.abs(seen).max(axis=0)
        chan[key] = m if key not in chan else np.maximum(chan[key], m)
        if ints is not None and key in ints:
            peak = float(np.abs(seen @ ints[key].T.astype(np.float32)).max())
            sums[key] = max(sums.get(key, 0.0), peak)
        return plain(i, name, x)

    model.project = project
    parts = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    for w in tqdm(parts, desc="calibrate", unit="window", file=sys.stderr, disable=None if progress is None else not progress):
        model.prefill(list(w), model.new_cache(), last_only=True)  # the head's logits are not needed
    return chan, sums
