"""fp16 values kept in float32 arrays: the emulator's working representation.

The ANE stores and computes fp16. The emulator keeps every value as a float32 that is exactly
an fp16 value, so numpy and BLAS work at float32 speed; `round_fp16` is the one place values
are brought onto the fp16 grid. numpy's own float16 casts are scalar loops on most x86 builds
(about 4 ns per element to fp16 and 3 ns back), which made them the emulator's largest cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np

F16_MAX = 65504.0
_EXP = np.uint32(0x7F800000)
_SIGN = np.uint32(0x80000000)
_MIN_EXP = np.uint32(113 << 23)  # 2**-14, the smallest normal fp16: below it the grid is fixed
_SHIFT = np.uint32((13 << 23) | 0x400000)  # 2**13 times the value's binade, times 1.5
_SMALL = 4096
_TOP_BINADE = np.uint32(142 << 23)  # 2**15: the only finite binade that can round past 65504


def round_fp16(a: Any) -> np.ndarray:
    """float32 -> nearest fp16 value (ties to even), as a new float32 array; overflow gives +-inf.

    Same result, bit for bit, as `a.astype(float16).astype(float32)`. Adding then subtracting
    C = 1.5 * 2**(e + 13), where 2**e is the value's binade (never below 2**-14), leaves the sum
    in a binade whose float32 ulp is the fp16 ulp at e, so the float32 adder does the rounding,
    ties to even included (C is an even number of those ulps), and fp16 subnormals come out on
    their fixed 2**-24 grid. The sign is copied back afterwards so that values rounding to zero
    keep theirs. inf and NaN pass through the add unchanged; values past the fp16 range become
    +-inf, checked only when the largest exponent (one max over the exponents) allows it.
    """
    if getattr(a, "dtype", None) == np.float16:
        return a.astype(np.float32)  # already fp16 values (inputs, blobs): exact
    a = np.asarray(a, dtype=np.float32)
    if a.size <= _SMALL:  # a dozen numpy calls cost more than the cast on a few thousand values
        with np.errstate(over="ignore"):
            return a.astype(np.float16).astype(np.float32)
    a = np.ascontiguousarray(a)  # the exponent work below is done in place, on flat views
    u = a.view(np.uint32)
    c = u & _EXP
    large = c.max() >= _TOP_BINADE  # |x| >= 2**15 somewhere (or inf/NaN): may overflow
    _at_least_min_exp(c)
    c += _SHIFT
    cf = c.view(np.float32)
    if large:  # (signalling NaNs raise 'invalid' in the add)
        with np.errstate(invalid="ignore"):
            y = a + cf
            y -= cf
            np.abs(y, out=cf)
            np.multiply(y, np.float32(np.inf), out=y, where=cf > F16_MAX)  # overflow: +-inf
    else:
        y = a + cf
        y -= cf
    np.bitwise_and(u, _SIGN, out=c)  # (np.copysign is a scalar loop: twice the time of these two)
    yu = y.view(np.uint32)
    yu |= c
    return y


_ROW = np.full(4096, _MIN_EXP, np.uint32)


def _at_least_min_exp(c: np.ndarray) -> None:
    """c = max(c, 2**-14's exponent) in place. numpy's maximum against a scalar is a scalar loop;
    against a row of the constant, broadcast over rows of c, it is vectorised (3x faster)."""
    flat = c.reshape(-1)
    body = flat.size - flat.size % _ROW.size
    rows = flat[:body].reshape(-1, _ROW.size)
    np.maximum(rows, _ROW, out=rows)
    np.maximum(flat[body:], _MIN_EXP, out=flat[body:])
