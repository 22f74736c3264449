"""Norm affines and int8: the one fold the kernels must not do to an int8 matrix, and the HF
names of each model type's int8 linears.

`kernels/prefill.layer_params` folds each norm's gain into the linears that read it,
W·(g ⊙ n) = (W·diag g)·n. That multiplies weight *columns*, so an int8 matrix would stop being
int8 times a row scale, and quantizing the folded matrix instead costs accuracy: on SmolLM2-135M
(256 held-out tokens of prose, CPU reference) int8 rows of the folded matrices raise perplexity
1.6 %, int8 rows of the HF matrices 0.7 %, since the gains (0.0003 to 0.6) spread each row's
columns over a wider range. So an int8 layer is built with unit gains, and each gain is applied
to the linear's input in the kernel (`QLinear.in_gain`, one mul that also carries the W8 shift).
The folds that scale whole rows (attention scale, residual stream scale) stay: requantizing a
row scaled by a power of two gives back the same int8 row (quant.core).

LayerNorm's shift (GPT-2) stays folded: W·(g ⊙ n + s) + b = W·(g ⊙ n) + (W·s + b) moves it into
the bias, which is fp16 anyway. So the tensor an int8 linear of GPT-2 quantizes is g ⊙ n, the
CPU model's input to it minus s: calibration measures that (`norm_shifts`).
"""

from __future__ import annotations

import numpy as np

from ..models.errors import InputError
from ..models.names import FAMILY, layer_prefix

# per model type: kernel linear (kernels/prefill.layer_params) -> the HF linears it is made of
KERNEL_LINEARS = {
    "llama": {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
              "gate": ("mlp.gate_proj",), "up": ("mlp.up_proj",), "down": ("mlp.down_proj",)},
    "gpt2": {"qkv": ("attn.c_attn",), "o": ("attn.c_proj",), "fc": ("mlp.c_fc",), "proj": ("mlp.c_proj",)},
}
# ... and each norm (HF name inside a layer) with the kernel linears that read its output
NORM_READERS = {"llama": {"input_layernorm": ("qkv",), "post_attention_layernorm": ("gate", "up")},
                "gpt2": {"ln_1": ("qkv",), "ln_2": ("fc",)}}
SUPPORTED = tuple(FAMILY)


def family(model_type: str) -> str:
    if model_type not in FAMILY:
        raise InputError(f"quantize supports {', '.join(SUPPORTED)} models; got model_type {model_type!r}")
    return FAMILY[model_type]


def check_supported(config) -> None:
    family(config.model_type)


def linear_names(config) -> list[str]:
    """Every int8 linear of the model, by HF name, layer by layer."""
    lin = KERNEL_LINEARS[family(config.model_type)]
    return [layer_prefix(config.model_type, i) + n for i in range(config.num_hidden_layers)
            for parts in lin.values() for n in parts]


def norm_shifts(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{HF linear: the norm shift s its CPU input carries and its int8 input does not} (GPT-2)."""
    fam, out = family(config.model_type), {}
    for i in range(config.num_hidden_layers):
        pre = layer_prefix(config.model_type, i)
        for norm, readers in NORM_READERS[fam].items():
            s = weights.get(pre + norm + ".bias")
            if s is not None:
                out.update({pre + n: np.asarray(s, np.float32) for r in readers for n in KERNEL_LINEARS[fam][r]})
    return out


def unfolded_params(shape, layer: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """(`layer_params` with unit norm gains, {kernel linear: the gain its input needs})."""
    from ..kernels.layers import layer_params  # noqa: PLC0415 - kernels import quant.core

    unit = dict(layer)
    gains = {}
    for norm, readers in NORM_READERS["gpt2" if shape.gpt2 else "llama"].items():
        g = layer[norm + ".weight"]
        unit[norm + ".weight"] = np.ones_like(g)
        gains.update({r: np.asarray(g, np.float32) for r in readers})
    return layer_params(shape, unit), gains
