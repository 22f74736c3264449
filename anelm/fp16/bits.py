"""float32 <-> fp16 conversions at memory speed, bit for bit as numpy's casts.

numpy's float16 casts are scalar loops on this x86 build (about 6 ns per element to fp16 and
4 ns back), and a 12-layer dim-768 kernel set converts 85 M weights each way when it is
compiled and planned. The same conversions written as integer and float operations on the
raw bit patterns, compiled with numba, vectorise and take about 1.2 ns per element; where the
CPU converts itself (x86's F16C, every arm64), the casts are LLVM's own `fptrunc`/`fpext`, one
instruction for 8 elements, about 0.4 ns. All give numpy's results exactly: round to nearest
even, overflow to inf, fp16 subnormals, and NaN payloads kept as numpy keeps them (to fp16 the
top mantissa bits, the lowest bit set when they vanish; the CPU would quiet a signalling NaN
instead, so NaNs take the bit path both ways). The CPU's float32 -> fp16 was checked against
numpy on all 2**32 float32 patterns once; the tests check ties, edges and a sweep.
"""

from __future__ import annotations

import platform

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from . import FP16_MAX

_U = np.uint32
_LIMIT = np.float32(FP16_MAX)
_MIN = 1 << 16  # below this many elements numpy's own cast is as quick as a call into numba


# Each result is computed every way and one is selected, without branches, so LLVM vectorises
# the loops: ryg's float_to_half_fast3_rtne and half_to_float_fast5, with numpy's NaN rule.
@numba.njit(nogil=True, cache=True)
def _soft_half_bits(b: np.uint32) -> np.uint16:
    sign = (b >> _U(16)) & _U(0x8000)
    f = b & _U(0x7FFFFFFF)
    m = (f >> _U(13)) & _U(0x3FF)
    big = (_U(0x7C00) | m | _U(m == 0)) if f > _U(255 << 23) else _U(0x7C00)  # NaN, else inf
    # below 2**-14: adding 0.5 lets the float adder round onto the subnormal grid, ties to even
    sub = np.float32(np.uint32(f).view(np.float32) + np.float32(0.5)).view(np.uint32) - _U(0x3F000000)
    # normal: rebias the exponent (0xC8000000 wraps to -112 << 23), round half to even
    normal = (f + _U(0xC8000FFF) + ((f >> _U(13)) & _U(1))) >> _U(13)
    o = big if f >= _U(143 << 23) else (sub if f < _U(113 << 23) else normal)
    return np.uint16(o | sign)


@intrinsic
def _fptrunc_half(typingctx, x):
    """The CPU's float32 -> fp16 (round to nearest even), as the fp16's bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return numba.types.uint16(numba.types.float32), codegen


@numba.njit(nogil=True, cache=True)
def _hard_half_bits(b: np.uint32) -> np.uint16:
    f = b & _U(0x7FFFFFFF)
    m = (f >> _U(13)) & _U(0x3FF)
    nan = ((b >> _U(16)) & _U(0x8000)) | _U(0x7C00) | m | _U(m == 0)  # numpy's NaN, not the CPU's
    return np.uint16(nan if f > _U(255 << 23) else _U(_fptrunc_half(np.uint32(b).view(np.float32))))


def _cpu_converts_half() -> bool:
    """Whether LLVM turns fptrunc to half into instructions here (else it would call a runtime
    routine the JIT does not provide)."""
    return platform.machine().lower() in ("arm64", "aarch64") or bool(llvm.get_host_cpu_features().get("f16c"))


_HARDWARE = _cpu_converts_half()
_half_bits = _hard_half_bits if _HARDWARE else _soft_half_bits


@numba.njit(nogil=True, cache=True)
def _to_half_bits(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.size):
        dst[i] = _half_bits(src[i])


@numba.njit(inline="always")
def clamped(x: np.float32) -> np.float32:
    """x within ±65504, inf included (NaN stays NaN): where every saturating conversion starts."""
    return x if not abs(x) > _LIMIT else (-_LIMIT if x < 0 else _LIMIT)


@numba.njit(nogil=True, cache=True)
def _to_saturated_half_bits(src: np.ndarray, dst: np.ndarray) -> None:
    """`_to_half_bits` of each value `clamped` first."""
    for i in range(src.size):
        dst[i] = _half_bits(np.float32(clamped(np.uint32(src[i]).view(np.float32))).view(np.uint32))


@numba.njit(nogil=True, cache=True)
def _fold_half_bits(w: np.ndarray, gain: np.ndarray, row_scale: np.ndarray, dst: np.ndarray) -> None:
    for r in range(w.shape[0]):
        s = row_scale[r]
        for c in range(w.shape[1]):
            dst[r, c] = _half_bits(np.float32(w[r, c] * gain[c] * s).view(np.uint32))


@numba.njit(nogil=True, cache=True)
def _soft_float_bits(h16: np.uint16) -> np.uint32:
    h = np.uint32(h16)
    o = (h & _U(0x7FFF)) << _U(13)
    exp = o & _U(0x0F800000)
    normal = o + _U((127 - 15) << 23)
    big = normal + _U((128 - 16) << 23)  # inf and NaN: the mantissa moves up unchanged
    sub = np.float32(np.uint32(normal + _U(1 << 23)).view(np.float32) - np.float32(2.0 ** -14)).view(np.uint32)
    r = big if exp == _U(0x0F800000) else (sub if exp == 0 else normal)
    return r | ((h & _U(0x8000)) << _U(16))


@intrinsic
def half_to_float32(typingctx, bits):
    """The CPU's fp16 -> float32 of 16 raw bits (exact; a NaN stays NaN, quieted): `fpext half`,
    which LLVM emits as F16C's `vcvtph2ps` (the emulator's fp16 products widen with it too)."""
    if bits != numba.types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return numba.types.float32(numba.types.uint16), codegen


@numba.njit(nogil=True, cache=True)
def _hard_float_bits(h16: np.uint16) -> np.uint32:
    h = np.uint32(h16)
    nan = ((h & _U(0x8000)) << _U(16)) | _U(0x7F800000) | ((h & _U(0x3FF)) << _U(13))  # as numpy: not quieted
    return nan if (h & _U(0x7FFF)) > _U(0x7C00) else np.float32(half_to_float32(h16)).view(np.uint32)


_float_bits = _hard_float_bits if _HARDWARE else _soft_float_bits


@numba.njit(nogil=True, cache=True)
def _from_half_bits(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.size):
        dst[i] = _float_bits(src[i])


def to_half(a: np.ndarray, out: np.ndarray | None = None, saturate: bool = False) -> np.ndarray:
    """`a.astype(np.float16)` for a float32 array, as a new C-contiguous array, or into `out`
    (a C-contiguous float16 array of a's shape). fp16 input is a plain copy (astype's is 6x slower).
    `saturate`: values past fp16's range become ±65504, not inf (a clamp in the same pass)."""
    a = np.asarray(a)
    if out is None:
        out = np.empty(a.shape, np.float16)
    elif out.dtype != np.float16 or not out.flags.c_contiguous or out.shape != a.shape:
        raise ValueError(f"to_half: out must be a C-contiguous float16 array of shape {a.shape}")
    if saturate and a.dtype == np.float32:
        _to_saturated_half_bits(np.ascontiguousarray(a).reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint16))
    elif saturate:
        np.copyto(out, np.clip(a, -_LIMIT, _LIMIT), casting="unsafe")
    elif a.dtype == np.float32 and a.size >= _MIN:
        _to_half_bits(np.ascontiguousarray(a).reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint16))
    else:
        with np.errstate(over="ignore"):
            np.copyto(out, a, casting="unsafe")
    return out


def from_half(h: np.ndarray) -> np.ndarray:
    """`h.astype(np.float32)` for an fp16 array (a read-only blob view too), as a new array."""
    h = np.asarray(h)
    if h.dtype != np.float16 or h.size < _MIN:
        return h.astype(np.float32)
    src = np.ascontiguousarray(h)
    out = np.empty(src.shape, np.float32)
    _from_half_bits(src.reshape(-1).view(np.uint16), out.reshape(-1).view(np.uint32))
    return out


def fold_to_half(w: np.ndarray, gain: np.ndarray, row_scale: np.ndarray | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """`to_half((w * gain[None, :]).astype(np.float32) * row_scale[:, None])` bit for bit (row
    scales float32, None: ones), into `out` (fp16, C-contiguous) or a new array, in one pass."""
    out = np.empty(w.shape, np.float16) if out is None else out
    rows = np.ones(w.shape[0], np.float32) if row_scale is None else np.asarray(row_scale, np.float32)
    if w.dtype == gain.dtype == np.float32 and w.size >= _MIN and out.flags.c_contiguous:
        _fold_half_bits(w, gain, rows, out.view(np.uint16))
    else:  # x·1 is x, bit for bit
        out[...] = to_half((w * gain[None, :]).astype(np.float32, copy=False) * rows[:, None])
    return out
