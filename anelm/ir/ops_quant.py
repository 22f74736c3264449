"""Affine quantization: quantize, dequantize, constexpr_affine_dequantize (iOS16-18 specs).

quantize:   q = clip(round(x / scale) + zero_point) in the int8/uint8 range
dequantize: x = scale * (q - zero_point)
A vector scale/zero_point runs along `axis`; a scalar applies everywhere.
"""

from __future__ import annotations

import numpy as np

from ..mil.program import NUMPY_DTYPES, TensorType
from .ops import REQUIRED, define
from .ops_common import FLOATS, along_axis, axis_of, bad, check_axis_param, need_float

QUANT_DTYPES = ("int8", "uint8")


def _axis(p, rank):
    return None if p.get("axis") is None else axis_of(int(p["axis"]), rank)


def _infer_quantize(t, p):
    x = t["input"]
    need_float(x, "input")
    if p["output_dtype"] not in QUANT_DTYPES:
        bad(f"output_dtype among {list(QUANT_DTYPES)}", repr(p["output_dtype"]))
    if t["scale"].dtype != x.dtype:
        bad(f"scale of the input dtype {x.dtype}", t["scale"].dtype)
    check_axis_param(t["scale"], x, p["axis"], "scale")
    if "zero_point" in t:
        if t["zero_point"].dtype != p["output_dtype"]:
            bad(f"zero_point of output_dtype {p['output_dtype']}", t["zero_point"].dtype)
        check_axis_param(t["zero_point"], x, p["axis"], "zero_point")
    return [TensorType(p["output_dtype"], x.shape)]


def round_half_away(v: np.ndarray) -> np.ndarray:
    """Ties away from zero (the M6 study's rounding of fp16 outputs; a profile switch)."""
    return np.copysign(np.floor(np.abs(v) + 0.5), v)


ROUNDINGS = {"half_even": np.round, "half_away": round_half_away}


def quantize_values(x, p, rounding: str = "half_even"):
    """quantize's compute with a rounding mode; saturates at the output dtype's range."""
    v = x["input"]
    ax = _axis(p, v.ndim)
    scale = along_axis(x["scale"], ax, v.ndim).astype(np.float32)
    zp = 0 if x.get("zero_point") is None else along_axis(x["zero_point"], ax, v.ndim).astype(np.float32)
    info = np.iinfo(NUMPY_DTYPES[p["output_dtype"]])
    q = np.clip(ROUNDINGS[rounding](v / scale) + zp, info.min, info.max)
    return [q.astype(NUMPY_DTYPES[p["output_dtype"]])]


def _quantize(x, p):
    # np.round is round-half-to-even, as MIL's reference implementation rounds
    return quantize_values(x, p, "half_even")


define("quantize", ("input", "scale", "zero_point"), _infer_quantize, _quantize,
       params={"axis": None, "output_dtype": REQUIRED}, optional=("zero_point",))


def _infer_dequant(data_name):
    def infer(t, p):
        q, scale = t[data_name], t["scale"]
        if q.dtype not in QUANT_DTYPES:
            bad(f"{data_name} of dtype int8 or uint8", q.dtype)
        if scale.dtype not in FLOATS:
            bad("scale of dtype fp16 or fp32", scale.dtype)
        check_axis_param(scale, q, p["axis"], "scale")
        if "zero_point" in t:
            check_axis_param(t["zero_point"], q, p["axis"], "zero_point")
        return [TensorType(scale.dtype, q.shape)]
    return infer


def _dequant(data_name):
    def compute(x, p):
        q = np.asarray(x[data_name]).astype(np.float32)
        ax = _axis(p, q.ndim)
        scale = along_axis(x["scale"], ax, q.ndim).astype(np.float32)
        zp = 0 if x.get("zero_point") is None else along_axis(x["zero_point"], ax, q.ndim).astype(np.float32)
        return [((q - zp) * scale).astype(np.float32)]
    return compute


define("dequantize", ("input", "scale", "zero_point"), _infer_dequant("input"), _dequant("input"),
       params={"axis": None}, optional=("zero_point",))
# every operand of a constexpr_* op sits in the [...] brackets; it is folded at compile time
define("constexpr_affine_dequantize", ("quantized_data", "scale", "zero_point"),
       _infer_dequant("quantized_data"), _dequant("quantized_data"),
       params={"axis": REQUIRED}, in_attrs=True, const_inputs=("quantized_data", "scale", "zero_point"))
