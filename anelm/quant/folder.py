"""The quantized folder `anelm quantize` writes (CONTRACTS §10), and reading it back.

    DIR/config.json                the source config + "quantization_config": {"quant_method":
                                   "anelm", "scheme": "w8"|"w8a8", "bits": 8, ...}
    DIR/tokenizer.json ...         the source's tokenizer
    DIR/model.safetensors          per linear P (HF name: model.layers.0.self_attn.q_proj,
                                   transformer.h.0.attn.c_attn):
        P.weight            I8  [out, in]  symmetric per row, zero point 0
        P.weight_scale      F32 [out]      the weight is P.weight · P.weight_scale[:, None]
        P.input_shift       F32 []         W8: the input is divided by it before the int8 sum
        P.input_scale       F32 []         W8A8: static per-tensor scale of the int8 input
        P.outlier_channels  I64 [k]        W8A8: input channels kept out of int8 (may be absent)
        P.outlier_weight    F32 [out, k]   their weight columns (zero in P.weight)
                                   every other tensor as the source had it, float32
    DIR/quantization_report.json   what `quantize` measured

Readers get float32 weights (the int8 dequantized, the outlier columns put back) in a
`QuantizedWeights` dict, which also carries the int8 decisions for the device kernels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..models.errors import InputError
from .core import InputQuant, dequantize_rows, kernel_layer
from .fold import KERNEL_LINEARS, layer_prefix, linear_names, unfolded_params

METHOD = "anelm"
SCHEMES = ("w8", "w8a8")


def quant_config(path: Path) -> dict | None:
    """The folder's quantization_config when it is one of ours, else None."""
    f = path / "config.json"
    if not (path.is_dir() and f.is_file()):
        return None
    try:
        qc = json.loads(f.read_text()).get("quantization_config")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == METHOD else None


def refuse_quantized(path, command: str) -> None:
    """One line for the commands that cannot take a quantized folder yet (CONTRACTS §10)."""
    if path is not None and quant_config(Path(path)) is not None:
        raise InputError(f"{path} is a quantized folder (anelm quantize); {command} needs the unquantized "
                         "model it came from")


class QuantizedWeights(dict):
    """Float32 weights (dequantized) plus `.quant`, the int8 plan the device pipeline builds from."""

    quant: "QuantPlan"


@dataclass(frozen=True)
class QuantPlan:
    scheme: str
    inputs: dict[str, InputQuant]  # HF linear name -> its input's decisions

    def kernel_layer(self, i: int, shape, layer: dict[str, np.ndarray]) -> dict:
        """Layer i's kernel params (`layer_params` form, HF names inside the layer in `layer`)
        with its linears as QLinear (quant.core) and the norm gains on their inputs."""
        fam = "gpt2" if shape.gpt2 else "llama"
        pre = layer_prefix(fam, i)
        per = {}
        for k, parts in KERNEL_LINEARS[fam].items():
            first = self.inputs[pre + parts[0]]  # one input: one scale and one set of outliers
            shift = max(self.inputs[pre + n].shift for n in parts)  # one conv: one shift
            per[k] = InputQuant(shift, first.act_scale, first.keep)
        p, gains = unfolded_params(shape, layer)
        return kernel_layer(p, per, gains)


def pack(config, weights: dict[str, np.ndarray], qs: dict, plan: QuantPlan) -> dict[str, np.ndarray]:
    """The tensors of model.safetensors: `qs` maps each linear to its (q, scale)."""
    out = {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}
    for name in linear_names(config):
        q, scale = qs[name]
        iq = plan.inputs[name]
        out[name + ".weight"] = q
        out[name + ".weight_scale"] = scale.astype(np.float32)
        out[name + ".input_shift"] = np.array(iq.shift, np.float32)
        if iq.act_scale is not None:
            out[name + ".input_scale"] = np.array(iq.act_scale, np.float32)
        if iq.keep is not None and len(iq.keep):
            out[name + ".outlier_channels"] = np.asarray(iq.keep, np.int64)
            out[name + ".outlier_weight"] = np.ascontiguousarray(weights[name + ".weight"][:, iq.keep], np.float32)
    return out


def unpack(raw: dict[str, np.ndarray], config, scheme: str, source: str) -> tuple[dict, QuantPlan]:
    """model.safetensors' tensors -> (float32 weights as an HF checkpoint holds them, QuantPlan)."""
    out = {k: v for k, v in raw.items() if not k.endswith((".weight_scale", ".input_shift", ".input_scale",
                                                         ".outlier_channels", ".outlier_weight"))}
    inputs = {}
    for name in linear_names(config):
        try:
            q, scale = raw[name + ".weight"], raw[name + ".weight_scale"]
        except KeyError as e:
            raise InputError(f"{source}: quantized folder lacks {e.args[0]}") from None
        if q.dtype != np.int8:
            raise InputError(f"{source}: {name}.weight is {q.dtype}; expected int8")
        w = dequantize_rows(q, scale)
        keep = raw.get(name + ".outlier_channels")
        if keep is not None:
            w[:, keep] = raw[name + ".outlier_weight"]
        out[name + ".weight"] = w
        act = raw.get(name + ".input_scale")
        inputs[name] = InputQuant(float(raw.get(name + ".input_shift", 1.0)),
                                  None if act is None else float(act), keep)
    if scheme == "w8a8" and any(iq.act_scale is None for iq in inputs.values()):
        raise InputError(f"{source}: scheme w8a8 but some linears have no input_scale")
    from ..models.loading import architecture  # noqa: PLC0415 - loading reads folders through here

    # the folder holds every linear [out, in], ours; the reader sanitizes from the checkpoint's
    # orientation (GPT-2's Conv1D [in, out]), as for any HF folder
    return architecture(config.model_type).unsanitize(out, config), QuantPlan(scheme, inputs)


def scheme_of(qc: dict, source: str) -> str:
    scheme = qc.get("scheme")
    if scheme not in SCHEMES:
        raise InputError(f"{source}: quantization_config scheme {scheme!r}; expected one of {list(SCHEMES)}")
    return scheme
