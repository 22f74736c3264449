"""fp16 values kept in float32 arrays: the emulator's working representation.

The ANE stores and computes fp16. The emulator keeps every value as a float32 that is exactly
an fp16 value, so numpy and BLAS work at float32 speed; `round_fp16` is the one place values
are brought onto the fp16 grid. numpy's own float16 casts are scalar loops on most x86 builds
(about 4 ns per element to fp16 and 3 ns back), and the same rounding written as numpy
array arithmetic takes eight passes over memory, which cost 3-5 ns per value inside a training
step, where the dW thread competes for memory bandwidth. Compiled with numba, it is one pass
that reads each value once and writes it once, in place when the caller owns the array.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ..caches import load_compiled
from . import FP16_MAX
from .bits import clamped, from_half

_EXP = np.uint32(0x7F800000)
_SIGN = np.uint32(0x80000000)
_MIN_EXP = np.uint32(113 << 23)  # 2**-14, the smallest normal fp16: below it the grid is fixed
# 2**16, the first binade wholly past fp16's range: above it C would leave float32 (at 2**115,
# 2**128 * 1.5 is a NaN pattern; higher, the exponent carries into the sign), and any C this
# large or larger rounds those values to something that overflows anyway
_MAX_EXP = np.uint32(143 << 23)
_SHIFT = np.uint32((13 << 23) | 0x400000)  # 2**13 times the value's binade, times 1.5
_MAX = np.float32(FP16_MAX)
_INF = np.float32(np.inf)


@numba.njit(inline="always")
def _rounded(x: np.float32) -> np.float32:
    """x rounded to fp16.

    Adding then subtracting C = 1.5 * 2**(e + 13), where 2**e is the value's binade (never
    below 2**-14, never above 2**16), leaves the sum in a binade whose float32 ulp is the fp16 ulp at e, so the
    float32 adder does the rounding, ties to even included (C is an even number of those ulps),
    and fp16 subnormals come out on their fixed 2**-24 grid. The sign is copied back afterwards
    so that values rounding to zero keep theirs. inf and NaN pass through the add unchanged;
    values past the fp16 range become +-inf.
    """
    bits = np.float32(x).view(np.uint32)
    c = np.uint32(min(max(bits & _EXP, _MIN_EXP), _MAX_EXP) + _SHIFT).view(np.float32)
    y = (x + c) - c
    if abs(y) > _MAX:
        y = _INF
    return np.uint32(np.float32(y).view(np.uint32) | (bits & _SIGN)).view(np.float32)


@numba.njit(inline="always")
def _saturated(x: np.float32) -> np.float32:
    """x rounded to fp16, past fp16's range the largest finite value of its sign (inf too; NaN
    stays NaN): `bits.clamped`, then `_rounded`, in one step, for what the CPU hands the device."""
    return _rounded(clamped(x))


# Two loops, not one with an aliasing check: LLVM vectorises each only when it can see whether
# source and destination are the same memory (a runtime overlap falls back to scalar code).
@numba.njit(nogil=True, cache=True)
def _round_into(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.size):
        dst[i] = _rounded(src[i])


@numba.njit(nogil=True, cache=True)
def _saturate_into(src: np.ndarray, dst: np.ndarray) -> None:
    for i in range(src.size):
        dst[i] = _saturated(src[i])


@numba.njit(nogil=True, cache=True)
def _round_in_place(a: np.ndarray) -> None:
    """Round a 1-D float32 array onto the fp16 grid in place (numpy's float16 cast, bit for bit)."""
    for i in range(a.size):
        a[i] = _rounded(a[i])


_TILE = 256  # tiles of 8x8 blocks: the blocks are transposed in registers, tiles stay in cache


@numba.njit(nogil=True, cache=True)
def _put_rows(src: np.ndarray, dst: np.ndarray, col0: int, rnd: bool, sat: bool) -> None:
    rows, n = src.shape
    for r in range(rows):
        if sat:
            for c in range(n):
                dst[r, col0 + c] = _saturated(src[r, c])
        elif rnd:
            for c in range(n):
                dst[r, col0 + c] = _rounded(src[r, c])
        else:
            dst[r, col0:col0 + n] = src[r]


@numba.njit(nogil=True, cache=True)
def _put_transposed(src_t: np.ndarray, dst: np.ndarray, col0: int) -> None:
    """dst[r, col0 + c] = src_t[c, r]. The fixed 8x8 inner loops are what LLVM turns into
    vector shuffles: 4x faster than numpy's copy through a transposed view."""
    n, rows = src_t.shape
    n8, rows8 = n - n % 8, rows - rows % 8
    for rt in range(0, rows8, _TILE):
        for ct in range(0, n8, _TILE):
            for c0 in range(ct, min(ct + _TILE, n8), 8):
                for r0 in range(rt, min(rt + _TILE, rows8), 8):
                    for j in range(8):
                        for i in range(8):
                            dst[r0 + j, col0 + c0 + i] = src_t[c0 + i, r0 + j]
    for r in range(rows):  # the edges outside whole 8x8 blocks
        for c in range(n8 if r < rows8 else 0, n):
            dst[r, col0 + c] = src_t[c, r]


def write_fp16_columns(src: np.ndarray, dst: np.ndarray, col0: int, exact: bool = False,
                       saturate: bool = False) -> None:
    """dst[:, col0:col0 + n] = src `[rows, n]`, rounded to fp16 unless `exact` says it holds
    fp16 values already; `saturate`: past fp16's range ±65504, not inf (`round_fp16`). dst: a
    C-contiguous float32 `[rows, width]` array.

    How the dynamic pipeline stages weights into columns of a packed input, Wᵀ as often as W:
    a transposed source (a `.T` view of a contiguous matrix) is rounded as it lies, then copied
    by 8x8 blocks, where numpy's copy through the transposed view costs about 3 ns per value.
    """
    rows, n = src.shape
    if dst.dtype != np.float32 or not dst.flags.c_contiguous or dst.ndim != 2 or dst.shape[0] != rows \
            or not 0 <= col0 <= dst.shape[1] - n:
        raise ValueError(f"write_fp16_columns: cannot write {list(src.shape)} at column {col0} of "
                         f"{list(dst.shape)} {dst.dtype}")
    if src.dtype == np.float32 and src.T.flags.c_contiguous and not src.flags.c_contiguous:
        _put_transposed(src.T if exact else round_fp16(src.T, saturate=saturate), dst, col0)
    else:
        _put_rows(np.ascontiguousarray(src, dtype=np.float32), dst, col0, not exact, saturate and not exact)


def round_fp16(a: Any, out: np.ndarray | None = None, saturate: bool = False) -> np.ndarray:
    """float32 -> nearest fp16 value (ties to even), as float32; overflow gives +-inf, or with
    `saturate` ±65504 (what a clamp before the rounding gives, in the same pass).

    Same result, bit for bit, as `a.astype(float16).astype(float32)`. With `out` (a writable
    C-contiguous float32 array of a's size: `a` itself, or memory `a` does not overlap) the
    result is written there and `out` is returned; otherwise a new array of a's shape is.
    """
    if getattr(a, "dtype", None) == np.float16 and not saturate:
        if out is None:
            return from_half(a)  # already fp16 values (inputs, blobs): exact
        out.reshape(-1)[:] = a.reshape(-1)
        return out
    src = np.asarray(a, dtype=np.float32)
    if not src.flags.c_contiguous:
        src = src.copy()
    if out is None:
        out = np.empty(src.shape, np.float32)
    elif out.size != src.size or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"round_fp16: out must be a C-contiguous float32 array of {src.size} values")
    if saturate:
        _saturate_into(src.reshape(-1), out.reshape(-1))
    elif out is src:
        _round_in_place(out.reshape(-1))
    else:
        _round_into(src.reshape(-1), out.reshape(-1))
    return out


def _owned_in_place(a: Any) -> bool:
    """a is a writable, C-contiguous float32 array (a fresh op result that can be rounded where it lies)."""
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable


def round_fp16_owned(a: np.ndarray) -> np.ndarray:
    """Round an array the caller owns (a fresh op result), in place when it can: a writable,
    C-contiguous float32 array is rounded where it lies; anything else gets a new array."""
    if _owned_in_place(a):
        _round_in_place(a.reshape(-1))  # round_fp16(a, out=a) without its checks: once per op result
        return a
    return round_fp16(a)


@numba.njit(nogil=True, cache=True)
def _count_nonfinite(a: np.ndarray) -> int:
    bad = np.int64(0)
    for i in range(a.size):
        bad += np.int64(not abs(a[i]) <= _MAX)  # inf and NaN both fail the test
    return bad


@numba.njit(nogil=True, cache=True)
def _round_counted_in_place(a: np.ndarray) -> int:
    """`_round_in_place`, returning how many results are not finite fp16 (the overflow watch's cue)."""
    bad = np.int64(0)
    for i in range(a.size):
        a[i] = _rounded(a[i])
        bad += np.int64(not abs(a[i]) <= _MAX)
    return bad


@numba.njit(nogil=True, cache=True)
def _round_then_count_in_place(a: np.ndarray) -> int:
    """`_round_counted_in_place` as two loops in one call, each vectorised (for large arrays)."""
    for i in range(a.size):
        a[i] = _rounded(a[i])
    return _count_nonfinite(a)


SMALL = 4096  # values below which one call's overhead outweighs the arithmetic

# every evaluation's rounding loops, ready when the emulator is imported (`load_compiled`)
_F32 = numba.types.Array(numba.float32, 1, "C")
load_compiled(_round_into, (_F32, _F32))
for _loop in (_round_in_place, _round_counted_in_place, _round_then_count_in_place, _count_nonfinite):
    load_compiled(_loop, (_F32,))


def round_fp16_owned_counted(a: np.ndarray) -> tuple[np.ndarray, int]:
    """round_fp16_owned, and how many of the results are inf or NaN (the emulator's fp16
    overflow diagnostics look further only when that is not 0). For a large result the count
    is a second loop over it while it is still in cache, about the rounding's own cost again
    (fused into the rounding loop it vectorises worse and costs twice as much), in the same
    compiled call (a second call cost ~1-2 us a step). A small result (a decode step's) is
    rounded and counted in one loop: there the call is the cost."""
    if _owned_in_place(a):
        counted = _round_counted_in_place if a.size < SMALL else _round_then_count_in_place
        return a, int(counted(a.reshape(-1)))
    r = round_fp16(a)
    return r, int(_count_nonfinite(r.reshape(-1)))
