"""Affine quantization: quantize, dequantize, constexpr_affine_dequantize (iOS16-18 specs), and
iOS 18's blockwise constexpr_blockwise_shift_scale (int4/uint4 weights, per-block scales) and
palettized constexpr_lut_to_dense (uint1..uint8 indices into per-block lookup tables).

quantize:   q = clip(round(x / scale) + zero_point) in the int8/uint8 range
dequantize: x = scale * (q - zero_point)
A vector scale/zero_point runs along `axis`; a scalar applies everywhere.
"""

from __future__ import annotations

import numpy as np

from ..mil.program import NUMPY_DTYPES, TensorType
from .op_table import REQUIRED, define
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


# --------------------------------------------------------------------------- iOS 18 blockwise
# constexpr_blockwise_shift_scale (coremltools' iOS18 `compression.py`): output = scale · (data −
# offset), scale and offset repeated over blocks of data.shape[i] / scale.shape[i] along each axis.
BLOCK_DATA = ("int4", "uint4", "int8", "uint8", "fp16", "fp32")


def _infer_blockwise(t, p):
    data, scale, offset = t["data"], t["scale"], t.get("offset")
    if data.dtype not in BLOCK_DATA:
        bad(f"data of dtype among {list(BLOCK_DATA)}", data.dtype)
    if scale.dtype not in FLOATS:
        bad("scale of dtype fp16 or fp32", scale.dtype)
    ds, ss = tuple(data.shape or ()), tuple(scale.shape or ())
    if not ds or len(ds) != len(ss) or any(s < 1 or d % s for d, s in zip(ds, ss)):
        bad(f"scale of data's rank {len(ds)} whose every dim divides data's {list(ds)}", list(ss))
    if offset is not None:
        if tuple(offset.shape or ()) != ss:
            bad(f"offset of scale's shape {list(ss)}", list(offset.shape or ()))
        if offset.dtype not in FLOATS and offset.dtype != data.dtype:
            bad(f"offset of dtype fp16, fp32 or data's {data.dtype}", offset.dtype)
    return [TensorType(scale.dtype, ds)]


def _in_fp16(a: np.ndarray) -> np.ndarray:
    """A float operand in the arithmetic the chip's fp16 consts get: the emulator hands its
    consts over as float32 arrays of fp16 values, which coremltools' definition would compute in
    fp16 (float16 scale: `data.astype(scale.dtype)`); values that are not all fp16 stay float32."""
    a = np.asarray(a)
    if a.dtype == np.float32 and np.array_equal(a.astype(np.float16).astype(np.float32), a, equal_nan=True):
        return a.astype(np.float16)
    return a


def blockwise_dense(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """coremltools' `constexpr_blockwise_shift_scale.decompress`, step for step, so that the
    roundings are numpy's own: data cast to the scale's dtype, scale and offset repeated per
    block along each axis, then (data − offset) and the product, each in that dtype (fp16:
    each rounded to fp16, the subtraction exact when the offset is an integer)."""
    scale = _in_fp16(scale)
    offset = None if offset is None else (_in_fp16(offset) if np.asarray(offset).dtype.kind == "f" else offset)
    data = np.asarray(data).astype(scale.dtype)
    for axis, (d, s) in enumerate(zip(data.shape, scale.shape)):
        if d // s > 1:
            scale = np.repeat(scale, d // s, axis)
            offset = None if offset is None else np.repeat(offset, d // s, axis)
    if offset is not None:
        data = data - offset
    return scale * data


define("constexpr_blockwise_shift_scale", ("data", "scale", "offset"), _infer_blockwise,
       lambda x, p: [blockwise_dense(x["data"], x["scale"], x.get("offset"))],
       in_attrs=True, optional=("offset",), const_inputs=("data", "scale", "offset"))


# --------------------------------------------------------------------------- iOS 18 palettized
# constexpr_lut_to_dense (coremltools' iOS18 `compression.py`): output[i] = lut[g(i), indices[i]],
# one table of 2^bits entries per block of indices.shape[j] / lut.shape[j] along each axis j.
# Scalar tables only (VECTOR_SIZE 1, no vector_axis): the form our kernels emit.
LUT_INDICES = ("uint1", "uint2", "uint3", "uint4", "uint6", "uint8")
LUT_VALUES = ("int8", "uint8", "fp16", "fp32")


def _infer_lut(t, p):
    idx, lut = t["indices"], t["lut"]
    if idx.dtype not in LUT_INDICES:
        bad(f"indices of dtype among {list(LUT_INDICES)}", idx.dtype)
    if lut.dtype not in LUT_VALUES:
        bad(f"lut of dtype among {list(LUT_VALUES)}", lut.dtype)
    ds, ls = tuple(idx.shape or ()), tuple(lut.shape or ())
    if not ds or len(ls) != len(ds) + 2 or any(s < 1 or d % s for d, s in zip(ds, ls)):
        bad(f"lut of rank {len(ds) + 2} whose first {len(ds)} dims divide indices' {list(ds)}", list(ls))
    bits = int(idx.dtype[4:])
    if ls[-2] != 2 ** bits:
        bad(f"lut's second last dim 2^{bits} = {2 ** bits} entries for {idx.dtype} indices", ls[-2])
    if ls[-1] != 1 or "vector_axis" in t:
        bad("a scalar lut (last dim 1, no vector_axis): vector palettization is not supported", list(ls))
    return [TensorType(lut.dtype, ds)]


def lut_dense(indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """coremltools' `optimize_utils.lut_to_dense` for VECTOR_SIZE 1: each table repeated over its
    block of indices, then the entry the index names. A selection: no arithmetic to round."""
    lut = _in_fp16(lut)
    indices = np.asarray(indices)
    rep = lut.reshape(lut.shape[:-1])  # [..blocks.., 2^bits]
    for axis, (d, s) in enumerate(zip(indices.shape, rep.shape)):
        if d // s > 1:
            rep = np.repeat(rep, d // s, axis)
    return np.take_along_axis(rep, indices.astype(np.int64)[..., None], axis=-1)[..., 0]


define("constexpr_lut_to_dense", ("indices", "lut", "vector_axis"), _infer_lut,
       lambda x, p: [lut_dense(x["indices"], x["lut"])],
       in_attrs=True, optional=("vector_axis",), const_inputs=("indices", "lut", "vector_axis"))
