"""Norm gains and int8: the one fold the kernels must not do to an int8 matrix.

`kernels/prefill.layer_params` folds each norm's gain into the linears that read it,
W·(g ⊙ n) = (W·diag g)·n. That multiplies weight *columns*, so an int8 matrix would stop being
int8 times a row scale, and quantizing the folded matrix instead costs accuracy: on SmolLM2-135M
(256 held-out tokens of prose, CPU reference) int8 rows of the folded matrices raise perplexity
1.6 %, int8 rows of the HF matrices 0.7 %, since the gains (0.0003 to 0.6) spread each row's
columns over a wider range. So an int8 layer is built with unit gains, and each gain is applied
to the linear's input in the kernel (`QLinear.in_gain`, one mul that also carries the W8 shift).
The folds that scale whole rows (attention scale, residual stream scale) stay: requantizing a
row scaled by a power of two gives back the same int8 row (quant.core).
"""

from __future__ import annotations

import numpy as np

from ..models.errors import InputError

# HF names inside a Llama/Qwen3 layer: each norm and the kernel linears that read its output
NORM_READERS = {"input_layernorm": ("qkv",), "post_attention_layernorm": ("gate", "up")}
SUPPORTED = ("llama", "qwen3")


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED:
        raise InputError(f"quantize supports {' and '.join(SUPPORTED)} models for now; "
                         f"got model_type {config.model_type!r}")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def unfolded_params(shape, layer: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """(`layer_params` with unit norm gains, {kernel linear: the gain its input needs})."""
    from ..kernels.layers import layer_params  # noqa: PLC0415 - kernels import quant.core

    unit = dict(layer)
    gains = {}
    for norm, readers in NORM_READERS.items():
        g = layer[norm + ".weight"]
        unit[norm + ".weight"] = np.ones_like(g)
        gains.update({r: np.asarray(g, np.float32) for r in readers})
    return layer_params(shape, unit), gains
