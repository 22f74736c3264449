"""The conv/matmul accumulator (docs/chip-profiles.md): a limit, and a precision switch.

fp16 `conv`, `matmul` and the two products inside `scaled_dot_product_attention` accumulate in a
register whose range ends at `accumulator_limit` (32768 in `strict`, measured on M4 and M6): a
result whose magnitude reaches it is ±inf, with the result's sign, although elementwise results
overflow only above 65504. The result is the accumulator's value, the sum of all products plus a
conv's bias (its initial value), before the op's rounding to fp16.

`accumulator` says how the sum is formed:

* `"fp32"`: in float32, as the op table computes; only the result is limited. One max and one
  min over the result decide; the work of writing the infs is done only when they trip, so the
  check is nearly free next to the product that made the result.
* `"q15.16"`: a fixed-point register with its LSB at 2^-16 (`_fixed_matmul`). How we read the
  rule as the M6 microarchitecture study words it, with the reason for each choice:
  - "exponent sum" is e(a) + e(b), where e(x) = floor(log2|x|) is the exponent of the operand's
    value (of a subnormal too): the product's magnitude is then under 2^(e(a) + e(b) + 2), so
    "at most -17" is the rule's "magnitudes under about 2^-15".
  - "summed on a 2^-16 grid": each kept product is truncated toward zero to a multiple of 2^-16
    (its low bits fall off the register's end as the product is aligned to it), then added
    exactly. Truncation, not rounding, because the drop rule is itself truncation: a register
    that rounded would keep products in [2^-17, 2^-15) as one or two LSBs instead of dropping
    them. A conv's bias, the initial value, is put on the grid the same way.
  - "in order along the contraction axis": products are added one at a time, k = 0, 1, ...;
    for a conv the axis runs over the kernel taps in (row, column) order, input channels inside
    each tap, as `ops_linear.conv_taps` lays them out. Once a partial sum (the initial value
    included) reaches the limit, the result is inf with that partial sum's sign, whatever
    follows.
  The exact fixed-point result is rounded straight to fp16 (float64 -> float16, ties to even
  like every op result): through float32 it would be rounded twice. It serves tests on small
  shapes and `anelm doctor`, not speed: products are formed in float64 by blocks of rows.

The int8 path accumulates in int32 and is not limited; it never reaches these functions, which
act on fp16 results only.
"""

from __future__ import annotations

from typing import Callable

import numba
import numpy as np

from ...caches import load_compiled
from ...chip.profile import ChipProfile
from ...ir.ops_linear import conv, conv_taps, matmul, sdpa

ACCUMULATED_OPS = ("conv", "matmul", "scaled_dot_product_attention")
ACCUMULATORS = ("fp32", "q15.16")
LSB = 2.0 ** -16  # the q15.16 register's grid
DROP_AT = -17  # products whose exponent sum is at most this are dropped
_BLOCK = 1 << 22  # products formed at once by the fixed-point path (float64: 32 MiB)


def accumulated(op: str, compute: Callable, dtype: str, profile: ChipProfile) -> Callable:
    """`compute` for op `op` with a `dtype` result, as this profile's accumulator computes it.

    The one place the profile's accumulator fields are read (but for the one-column fp32 path
    of `emulator.matvec`, which applies the same limit); ops without an accumulator, and
    results that are not fp16, come back unchanged.
    """
    limit, kind = profile.accumulator_limit, profile.accumulator
    if op not in ACCUMULATED_OPS or dtype != "fp16" or (limit is None and kind == "fp32"):
        return compute
    if kind not in ACCUMULATORS:
        raise ValueError(f"chip profile '{profile.name}': accumulator {kind!r}; expected one of {list(ACCUMULATORS)}")
    if kind == "fp32":
        if op == "scaled_dot_product_attention":
            return lambda x, p: sdpa(x, p, mm=lambda a, b: saturate(np.matmul(a, b), limit))
        return Saturated(compute, float(limit))
    cap = np.inf if limit is None else float(limit)
    if op == "conv":
        return lambda x, p: [_to_fp16(r) for r in conv(x, p, conv2d=lambda v, w, b, q: _fixed_conv2d(v, w, b, q, cap))]
    if op == "matmul":
        return lambda x, p: [_to_fp16(r) for r in matmul(x, p, mm=lambda a, b: _fixed_matmul(a, b, cap))]
    # attention's intermediates stay float32, as the op table keeps them; only the sums change
    return lambda x, p: sdpa(x, p, mm=lambda a, b: _fixed_matmul(a, b, cap).astype(np.float32))


class Saturated:
    """`compute` with the fp32 accumulator's limit on its results: a class rather than a closure,
    so that the emulator's bound steps (emulator.steps) can bind the compute it wraps."""

    def __init__(self, compute: Callable, limit: float):
        self.compute, self.limit = compute, limit

    def __call__(self, x: dict, p: dict) -> list[np.ndarray]:
        return [saturate(r, self.limit) for r in self.compute(x, p)]


@numba.njit(nogil=True, cache=True)
def _below(a: np.ndarray, limit: float) -> bool:  # pragma: no cover - compiled
    for i in range(a.size):
        if not abs(a[i]) < limit:  # NaN fails too
            return False
    return True


load_compiled(_below, (numba.types.Array(numba.float32, 1, "C"), numba.float64))  # every profile's accumulator check


def saturate(a: np.ndarray, limit: float) -> np.ndarray:
    """a with ±inf where |a| >= limit (NaN stays NaN). Reads a once (small contiguous float32:
    one compiled loop, cheaper to call than two reductions) or twice (max, min) when nothing trips."""
    if a.size == 0:
        return a
    if a.size < 4096 and a.dtype == np.float32 and a.flags.c_contiguous:
        if _below(a.reshape(-1), float(limit)):
            return a
    elif a.max() < limit and -a.min() < limit:  # NaN fails both tests: slow path
        return a
    inf = np.float32(np.inf)
    return np.where(np.abs(a) >= limit, np.copysign(inf, a), a).astype(a.dtype, copy=False)


def _to_fp16(a: np.ndarray) -> np.ndarray:
    """The exact float64 accumulator value, rounded once to fp16 (held as float32)."""
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float64).astype(np.float16).astype(np.float32)


def _exponent(x: np.ndarray) -> np.ndarray:
    """floor(log2|x|) for finite nonzero x (frexp gives x = m·2^e with 0.5 <= |m| < 1)."""
    return np.frexp(x)[1] - 1


def _fixed_matmul(a: np.ndarray, b: np.ndarray, cap: float, init: np.ndarray | None = None) -> np.ndarray:
    """a @ b `[..., M, K] @ [..., K, N]` in the q15.16 register, as float64 (see the module doc).

    `init`, broadcastable to `[..., M, N]`, is the initial value. Every quantity is an integer
    count of LSBs held in float64: each product below fp16's 65504² · 2^16 < 2^48, and every
    partial sum before the limit trips under 2^31 + 2^48, so all of it is exact until the limit
    is reached, and after that only whether and with which sign it was reached matters.
    """
    vec_a, vec_b = a.ndim == 1, b.ndim == 1
    a64 = np.asarray(a, np.float64)[None] if vec_a else np.asarray(a, np.float64)  # [M=1, K]
    b64 = np.asarray(b, np.float64)[:, None] if vec_b else np.asarray(b, np.float64)  # [K, N=1]
    batch = np.broadcast_shapes(a64.shape[:-2], b64.shape[:-2])
    (m, k), n = a64.shape[-2:], b64.shape[-1]
    a64, b64 = np.broadcast_to(a64, batch + (m, k)), np.broadcast_to(b64, batch + (k, n))
    acc0 = np.zeros(batch + (m, n)) if init is None else np.broadcast_to(_on_grid(np.asarray(init, np.float64)),
                                                                         batch + (m, n))
    ea, eb = _exponent(a64), _exponent(b64)
    out = np.empty(batch + (m, n))
    rows = max(1, _BLOCK // max(1, int(np.prod(batch, dtype=np.int64)) * k * n))
    for r0 in range(0, m, rows):
        r = slice(r0, r0 + rows)
        prod = a64[..., r, :, None] * b64[..., None, :, :]  # [..., rows, K, N], exact in float64
        kept = (ea[..., r, :, None] + eb[..., None, :, :] > DROP_AT) | ~np.isfinite(prod)
        terms = np.where(kept, _on_grid(prod), 0.0)
        start = acc0[..., r, None, :]
        sums = np.concatenate([start, start + np.cumsum(terms, axis=-2)], axis=-2)  # every partial sum
        hit = np.abs(sums) >= cap / LSB
        first = np.take_along_axis(sums, hit.argmax(axis=-2)[..., None, :], axis=-2)[..., 0, :]
        out[..., r, :] = np.where(hit.any(axis=-2), np.copysign(np.inf, first), sums[..., -1, :] * LSB)
    if vec_a:
        out = out[..., 0, :]
    return out[..., 0] if vec_b else out


def _on_grid(x: np.ndarray) -> np.ndarray:
    """x in LSBs, truncated toward zero (inf and NaN pass through)."""
    with np.errstate(invalid="ignore"):
        return np.trunc(x / LSB)


def _fixed_conv2d(v: np.ndarray, w: np.ndarray, bias, p: dict, cap: float) -> np.ndarray:
    """A 2-D conv in the q15.16 register: one contraction over (tap, channel), bias first."""
    n, oc = v.shape[0], w.shape[0]
    (oh, ow), taps = conv_taps(v, w.shape, p)
    w_col = np.concatenate([w_tap(w) for w_tap, _ in taps], axis=-1)  # (G, OC/G, taps·C/G)
    x_col = np.concatenate([x_tap for _, x_tap in taps], axis=-2)  # (N, G, taps·C/G, OH·OW)
    g = w_col.shape[0]
    init = None if bias is None else np.asarray(bias, np.float64).reshape(1, g, oc // g, 1)
    out = _fixed_matmul(w_col[None], x_col, cap, init)  # (N, G, OC/G, OH·OW)
    return out.reshape(n, oc, oh, ow)
