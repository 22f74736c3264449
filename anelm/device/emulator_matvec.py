"""fp16-resident weights for the decode path: matrix-vector products that stream fp16.

The ANE holds its weights as fp16; the emulator's working form is float32 arrays of fp16
values (`fp16`), which BLAS multiplies at full speed when a program runs over many columns
(prefill, training: compute-bound). A decode program runs one column: a matrix-vector product,
bound by reading the weights, so float32 weights read twice the bytes the chip reads and hold
twice the memory. Here a 1x1 conv's const weight is a `ResidentWeight` that takes the form its
evaluations need:

* evaluated one column at a time, it is the raw 16-bit fp16 patterns (`uint16`): a view of the
  BLOBFILE's bytes when the weight is a blob (`emulator_plan` never decodes it to float32), else
  made from the float32 copy, which is then dropped; `matvec_fp16` widens each element as it streams past (the F16C
  instruction `vcvtph2ps`, which LLVM emits for the `fpext half` of `half_to_float32`) and
  accumulates in float32;
* evaluated over more columns, it is (or becomes again, once, for good) float32 for BLAS.

The accumulator modelled is `"accumulator": "fp32"` (CONTRACTS §2.9): the sum of the products
in float32, in an order the contract leaves open, then the profile's limit (as
`emulator_accum.accumulated` applies it to the op table's conv) and the rounding of the result to fp16. The
float32 sums here are formed in another order than BLAS forms them (eight lanes and several
partial sums, fused multiply-adds), so a result close to a rounding boundary can land one fp16
ulp away from the BLAS path's; `tests/device/test_emulator_matvec.py` measures how often. The q15.16
register (`emulator_accum`) prescribes its order and keeps its own path; so do int8 weights.
"""

from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..chip.profile import ChipProfile
from ..ir.ops_common import as_list
from ..ir.ops_linear import conv
from ..mil.half import from_half, to_half
from .emulator_accum import saturate


@intrinsic
def half_to_float32(typingctx, bits):
    """The fp16 value of 16 raw bits, as float32 (exact; NaNs stay NaN, quieted)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


# reassociation lets LLVM split each row's sum over vector lanes: the fp32 accumulator's order
# is open (module doc); nothing else is relaxed (no reciprocal or zero-sign shortcuts)
@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def matvec_fp16(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[o] = Σ_k w[o, k]·x[k]: w `[OC, C]` uint16 fp16 patterns, x and out float32."""
    oc, c = w.shape
    for o in range(oc):
        acc = np.float32(0.0)
        for k in range(c):
            acc += half_to_float32(w[o, k]) * x[k]
        out[o] = acc


def half_bits(values: np.ndarray) -> np.ndarray:
    """fp16 values (float32 or float16) -> their raw uint16 patterns, same shape."""
    if values.dtype == np.float16:
        return np.ascontiguousarray(values).view(np.uint16)
    return to_half(np.asarray(values, np.float32)).view(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    """uint16 fp16 patterns -> float32 values, same shape."""
    return from_half(np.ascontiguousarray(bits, np.uint16).view(np.float16))


def half_matvec(bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """bits `[OC, C]` (uint16 fp16 patterns) times x `[C]`: float32 `[OC]`, summed in float32."""
    out = np.empty(bits.shape[0], np.float32)
    matvec_fp16(bits, np.ascontiguousarray(x, np.float32), out)
    return out


class ResidentWeight:
    """A 1x1 conv weight `[OC, C, 1(, 1)]` held in one form at a time: fp16 patterns while every
    evaluation has been one column wide, float32 once one was wider. `values` are float32 fp16
    values, or float16 (a BLOBFILE's bytes, viewed in place: the patterns themselves, held as
    they are, with no float32 copy made)."""

    def __init__(self, values: np.ndarray):
        self.shape = values.shape
        half = values.dtype == np.float16
        self.f32: np.ndarray | None = None if half else values
        self.f16: np.ndarray | None = values.reshape(self.shape[0], -1).view(np.uint16) if half else None
        self.wide = False  # an evaluation over several columns has happened: float32 for good
        self._lock = threading.Lock()

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """W·x for one column x `[C]` as float32 `[OC]`."""
        f16 = self.f16
        if f16 is None and not self.wide:
            with self._lock:
                if self.f16 is None and not self.wide:
                    self.f16 = half_bits(self.f32.reshape(self.shape[0], -1))
                    self.f32 = None
                f16 = self.f16
        if f16 is not None:
            return half_matvec(f16, x)
        return self.matrix().reshape(self.shape[0], -1) @ np.asarray(x, np.float32)

    def matrix(self) -> np.ndarray:
        """The float32 weight for BLAS; from now on the resident form."""
        f32 = self.f32
        if f32 is None:
            with self._lock:
                if self.f32 is None:
                    self.f32, self.f16 = widen(self.f16).reshape(self.shape), None
                f32 = self.f32
        self.wide = True
        return f32

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.f32, self.f16) if a is not None)


class ResidentConv:
    """conv's compute with a ResidentWeight in place of the weight operand, and the fp32
    accumulator's limit on the sum (bias included), as `emulator_accum.accumulated` applies it."""

    def __init__(self, weight: ResidentWeight, limit: float | None):
        self.weight, self.limit = weight, limit

    def __call__(self, x: dict, p: dict) -> list[np.ndarray]:
        v, bias = x["x"], x.get("bias")
        if v.shape[0] * int(np.prod(v.shape[2:])) == 1:  # one column: the decode path
            out = self.weight.matvec(v.reshape(-1)).reshape((1, -1) + (1,) * (v.ndim - 2))
            out = out if bias is None else out + bias.reshape(out.shape)
        else:
            out = conv({**x, "weight": self.weight.matrix()}, p)[0]
        return [out if self.limit is None else saturate(out, self.limit)]


def resident_conv(op: str, tensors: list, params: dict, consts: dict, dtype: str, profile: ChipProfile,
                  held: dict[str, ResidentWeight], halves: dict[str, np.ndarray]) -> tuple[ResidentConv, list] | None:
    """(compute, tensors without the weight) for a 1x1 conv on a const fp16 weight whose sums the
    fp32 accumulator forms, else None. The weight is a const (float32) or, not decoded yet, an
    fp16 blob view in `halves`. `held` maps const names to their ResidentWeight, so a weight that
    several convs read is held once."""
    if op != "conv" or dtype != "fp16" or profile.compute_dtype != "fp16" or profile.accumulator != "fp32":
        return None
    keys = dict(tensors)
    wkey, xkey = keys.get("weight"), keys.get("x")
    w = consts.get(wkey, halves.get(wkey)) if isinstance(wkey, str) else None
    if not isinstance(w, np.ndarray) or w.dtype not in (np.float32, np.float16) or w.ndim not in (3, 4) \
            or any(d != 1 for d in w.shape[2:]) or not isinstance(xkey, str) or not _plain(params):
        return None
    if wkey not in held:
        held[wkey] = ResidentWeight(np.ascontiguousarray(w))
    return ResidentConv(held[wkey], profile.accumulator_limit), [(k, v) for k, v in tensors if k != "weight"]


def _plain(p: dict[str, Any]) -> bool:
    """Params under which a 1x1 conv is one product over channels (ops_linear._conv2d's fast path)."""
    return int(p["groups"]) == 1 and p["pad_type"] in ("valid", "same", "same_lower") \
        and all(int(s) == 1 for s in as_list(p["strides"] or [1]))


class HalfMatrix:
    """A float matrix `[R, C]` held as fp16 patterns (half the memory of float32): indexing
    widens the rows it picks (an embedding lookup); `times` multiplies rows of activations."""

    BLOCK = 4096  # rows widened at once when many activations share the matrix

    def __init__(self, values: np.ndarray):
        self.bits = half_bits(values)
        self.shape = self.bits.shape

    def __getitem__(self, rows) -> np.ndarray:
        return widen(self.bits[rows])

    def times(self, x: np.ndarray) -> np.ndarray:
        """x `[T, C]` @ matrixᵀ -> float32 `[T, R]`: one fp16 pass per row of x when there are
        few, float32 BLAS over blocks of widened rows when there are many."""
        x = np.ascontiguousarray(x, np.float32)
        if len(x) <= 2:
            return np.stack([half_matvec(self.bits, row) for row in x])
        out = np.empty((len(x), self.shape[0]), np.float32)
        for r in range(0, self.shape[0], self.BLOCK):
            out[:, r:r + self.BLOCK] = x @ widen(self.bits[r:r + self.BLOCK]).T
        return out
