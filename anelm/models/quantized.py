"""INT8 weights as stored (CONTRACTS §10): the row quantization, the HF names of each model
type's int8 linears, and the quantized folder `anelm quantize` writes, read back here.

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
`QuantizedWeights` dict, which also carries the int8 decisions (`QuantPlan`) the device
kernels are built from (`anelm/kernels/int8.py`); `anelm/quant/` is the tool that makes them.

Rows: a weight row w is stored as q = round(w / s) with s = max|w| / 127, q in [-127, 127]:
symmetric, zero point 0, so a row's largest weight is exactly ±127 and the row scale is
recovered from the dequantized row as max|q·s| / 127. That is what lets the kernels be built
from the dequantized weights: the folds `layer_params` applies to a projection with unit norm
gains (the attention scale, the residual stream scale) multiply whole rows by one factor each,
so requantizing a folded row gives back the same q with the factor in its scale, bit for bit
(tests/quant). One rounding rule, half to even (np.round), as the MIL reference quantizes;
`maderix` rounds half away from zero, which differs only at exact ties and is immaterial for
weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InputError
from .names import FAMILY, PROJECTIONS, layer_prefix, module_name

METHOD = "anelm"
SCHEMES = ("w8", "w8a8")
QMAX = 127  # symmetric: -128 is never used, so negating a row never overflows

SUPPORTED = tuple(FAMILY)


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out]) with w ≈ q · scale[:, None].
    An all-zero row gets scale 1 (q = 0), so every scale is a positive number."""
    w = np.asarray(w, np.float32)
    peak = np.abs(w).max(axis=1)
    scale = np.where(peak > 0, peak / np.float32(QMAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def power_of_two_above(x: float) -> float:
    """The smallest power of two >= x (>= 1): an exact factor to move between two operands."""
    return 1.0 if x <= 1.0 else float(2.0 ** math.ceil(math.log2(x)))


@dataclass(frozen=True)
class InputQuant:
    """What calibration decided for one linear input (shared by the projections that read it)."""

    shift: float = 1.0  # W8
    act_scale: float | None = None  # W8A8
    keep: np.ndarray | None = None  # W8A8 outlier channels


def family(model_type: str) -> str:
    if model_type not in FAMILY:
        raise InputError(f"quantize supports {', '.join(SUPPORTED)} models; got model_type {model_type!r}")
    return FAMILY[model_type]


def check_supported(config) -> None:
    family(config.model_type)


def linear_names(config) -> list[str]:
    """Every int8 linear of the model, by HF module name, layer by layer: all its projections
    (`names.PROJECTIONS`; the device fuses q, k and v into one conv, `kernels/int8.plan_layer`)."""
    check_supported(config)  # an unknown model type: one InputError line, not a KeyError
    return [module_name(config.model_type, i, role) for i in range(config.num_hidden_layers)
            for role in PROJECTIONS[config.model_type]]


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
    model_type: str  # whose layer prefix the names carry

    def layer(self, i: int) -> dict[str, InputQuant]:
        """Layer i's decisions by the module names inside the layer (`self_attn.q_proj`), as the
        kernels, which know a layer's parts by role and not the model type's prefix, look them up."""
        pre = layer_prefix(self.model_type, i)
        return {k[len(pre):]: v for k, v in self.inputs.items() if k.startswith(pre)}


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
    from .loading import architecture  # noqa: PLC0415 - loading reads folders through here

    # the folder holds every linear [out, in], ours; the reader sanitizes from the checkpoint's
    # orientation (GPT-2's Conv1D [in, out]), as for any HF folder
    return architecture(config.model_type).unsanitize(out, config), QuantPlan(scheme, inputs, config.model_type)


def scheme_of(qc: dict, source: str) -> str:
    scheme = qc.get("scheme")
    if scheme not in SCHEMES:
        raise InputError(f"{source}: quantization_config scheme {scheme!r}; expected one of {list(SCHEMES)}")
    return scheme
