"""fp16-resident weights: conv products that read the fp16 patterns, never a float32 copy.

The ANE holds its weights as fp16; the emulator's working form is float32 arrays of fp16
values (`fp16`). Float32 weights hold twice the memory and, where a product is bound by reading
them, cost twice the time. Here a 1x1 conv's const weight is a `ResidentWeight`: its raw 16-bit
fp16 patterns (`uint16`), a view of the BLOBFILE's bytes when the weight is a blob
(`emulator.plan` never decodes it to float32), else made from the float32 copy, which is then
dropped. Its evaluations:

* one column (decode): `matvec_fp16` widens each element as it streams past (the F16C
  instruction `vcvtph2ps`, which LLVM emits for the `fpext half` of `half_to_float32`) and
  accumulates in float32;
* a few columns (prefill: up to NARROW, a multiple of 16): `narrow_times` widens four rows
  at a time into a scratch that stays in L1 and multiplies them with x in 4x16 register tiles,
  each sum held in a register over the whole of C. OpenBLAS's sgemm is weak this narrow (its
  Haswell kernel reached ~42 GFLOP/s at 16 columns, 76 at 64) and needs the whole row block
  widened first. Against widen+BLAS on SmolLM2's and GPT-2's shapes (alternating rounds, one
  thread, best of 15): 0.55-0.75x its time at 16 columns, 0.75-0.95x at 32; at 64 1.0-1.5x
  (x no longer stays in L1/L2 between row blocks), so NARROW is 32. In a prefill the weights
  stream from memory (SmolLM2's 30 layers: 212 MB), so each tile prefetches the next rows'
  patterns while it computes; a 16-token SmolLM2 prefill's products took 55-90 ms against
  widen+BLAS's 100-145 (same machine, load 2-3). A conv's bias and accumulator limit are
  applied to each tile while it is in L1;
* more columns (training): `half_times` widens a block of rows at a time into a
  per-thread scratch (`SCRATCH`, 1 MB) and multiplies it with float32 BLAS into those output
  rows. Measured against one product with a float32 copy of the whole weight (SmolLM2's and
  stories110m's shapes, 16 to 1024 columns, weights not in cache, alternating rounds): 0.8-1.0x
  its time at prefill widths, where fp16 reads half the bytes, and within 5% (the machine's
  noise) at training widths; 256 KB blocks were up to 1.2x slower at 256 columns (one BLAS call
  per 32 rows of a 2048-wide weight). So there is no float32 copy to switch to: a weight
  evaluated wide over and over (training, chat turns) stays fp16, and its memory stays half.

The accumulator modelled is `"accumulator": "fp32"` (docs/chip-profiles.md): the sum of the
products in float32, in an order the profile leaves open, then the profile's limit (as
`emulator.accum.accumulated` applies it to the op table's conv) and the rounding of the result to fp16. The
float32 sums here are formed in other orders than one whole-matrix BLAS product forms them:
the matrix-vector product's eight lanes and several partial sums, the tiles' one sum in k
order (fused multiply-adds), and BLAS's own kernels, which depend on the block's row count
(OpenBLAS gives other float32 sums for some rows of a row block than for the same rows of the
whole matrix). A result close to a rounding boundary
can so land one fp16 ulp away from the whole-matrix product's; `tests/device/test_emulator_matvec.py`
measures how often. The q15.16 register (`emulator.accum`) prescribes its order and keeps its
own path; so do int8 weights.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable

import numba
import numpy as np
import xxhash
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...caches import load_compiled
from ...chip.profile import ChipProfile
from ...fp16.bits import from_half, half_to_float32, to_half
from ...ir.ops_common import as_list
from .accum import saturate


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


@numba.njit(nogil=True, cache=True)
def widen_into(bits: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[i] = the fp16 value of bits[i] (1-D uint16 -> 1-D float32, preallocated): `vcvtph2ps`,
    eight at a time: 0.25 ns an element streamed from memory, `from_half` 0.46 (it keeps numpy's
    NaN rule; here `fpext` quiets a signalling NaN, which the weights never hold)."""
    for i in range(bits.size):
        out[i] = half_to_float32(bits[i])


SCRATCH = 1 << 18  # float32 elements widened at once (1 MB; module doc)
_scratch = threading.local()  # one buffer per thread: the training kernels evaluate from workers


def widened_rows(bits: np.ndarray):
    """(first row, float32 block) for consecutive row blocks of bits `[R, C]` (fp16 patterns),
    each widened into this thread's scratch, which the next block overwrites."""
    r_all, c = bits.shape
    rows = max(16, SCRATCH // max(c, 1))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * c:
        buf = _scratch.buf = np.empty(rows * c, np.float32)
    for r in range(0, r_all, rows):
        block = bits[r:r + rows]
        n = len(block) * c
        widen_into(block.reshape(-1), buf[:n])
        yield r, buf[:n].reshape(len(block), c)


TILE_ROWS, TILE_COLUMNS = 4, 16  # one register tile: 4 x 16 float32 sums, eight 8-lane registers
NARROW = 32  # the widest product the tiles take; wider, BLAS (module doc)


@intrinsic
def _tile_4x16(typingctx, w, ldw, x, ldx, out, ldo, depth, ahead):
    """out[i·ldo + j] = Σ_{k < depth} w[i·ldw + k]·x[k·ldx + j] for i < 4, j < 16: addresses of
    float32 arrays, strides in elements. The 64 sums stay in eight 8-lane registers for the
    whole sum, in k order, one fused multiply-add each step; each step loads x's 16 values once
    and broadcasts each row's weight straight from memory (a load, not a shuffle)."""
    sig = types.void(types.uintp, types.intp, types.uintp, types.intp, types.uintp, types.intp, types.intp, types.uintp)

    def codegen(context, builder, sig, args):
        w, ldw, x, ldx, out, ldo, depth, ahead = args
        f32, i64 = ir.FloatType(), ir.IntType(64)
        v8 = ir.VectorType(f32, 8)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]), "llvm.fmuladd.v8f32")
        lanes0 = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)

        def at(base, index, vector=False):  # the float32 (or 8 of them) at element `index` of `base`
            addr = builder.add(base, builder.mul(index, ir.Constant(i64, 4)))
            return builder.inttoptr(addr, (v8 if vector else f32).as_pointer())

        # allocas in the entry block, which LLVM promotes to registers
        acc = [cgutils.alloca_once_value(builder, ir.Constant(v8, [0.0] * 8)) for _ in range(2 * TILE_ROWS)]
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                  "llvm.prefetch.p0i8")
        with cgutils.for_range(builder, depth) as loop:
            k = loop.index
            # the next rows' fp16 patterns (8 bytes a step: the four rows' 8·depth bytes), so that
            # memory streams them while this tile computes
            addr = builder.inttoptr(builder.add(ahead, builder.mul(k, ir.Constant(i64, 8))), i8p)
            builder.call(prefetch, [addr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            row = builder.mul(k, ldx)
            xs = [builder.load(at(x, builder.add(row, ir.Constant(i64, 8 * h)), True), align=4) for h in (0, 1)]
            for i in range(TILE_ROWS):
                wk = builder.load(at(w, builder.add(builder.mul(ir.Constant(i64, i), ldw), k)), align=4)
                lane0 = builder.insert_element(ir.Constant(v8, None), wk, ir.Constant(ir.IntType(32), 0))
                splat = builder.shuffle_vector(lane0, ir.Constant(v8, None), lanes0)
                for h in (0, 1):
                    a = acc[2 * i + h]
                    builder.store(builder.call(fma, [splat, xs[h], builder.load(a)]), a)
        for i in range(TILE_ROWS):
            for h in (0, 1):
                index = builder.add(builder.mul(ir.Constant(i64, i), ldo), ir.Constant(i64, 8 * h))
                builder.store(builder.load(acc[2 * i + h]), at(out, index, True), align=4)
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(nogil=True, cache=True)
def _finish(out: np.ndarray, o: int, n: int, j: int, bias: np.ndarray, limit: float) -> None:  # pragma: no cover
    """The bias (none when empty) and the accumulator's limit on a tile's n rows from row o,
    16 columns from j, while they are in L1: `saturate`'s rule, |sum| >= limit -> ±inf, NaN kept."""
    for i in range(n):
        for jj in range(TILE_COLUMNS):
            v = out[o + i, j + jj]
            if bias.size:
                v += bias[o + i]
            out[o + i, j + jj] = math.copysign(math.inf, v) if abs(v) >= limit else v


@numba.njit(nogil=True, cache=True)
def narrow_times(bits: np.ndarray, x: np.ndarray, out: np.ndarray, bias: np.ndarray,
                 limit: float) -> None:  # pragma: no cover - compiled
    """out = bits·x (+ bias, then the limit: `_finish`): bits `[OC, C]` fp16 patterns, x `[C, T]`
    and out `[OC, T]` float32, all C-contiguous, T a multiple of 16. Four rows at a time are
    widened into a small scratch (in L1), then multiplied with each 16 columns of x in register
    tiles; a last partial block of rows is padded with zero rows into a spare tile."""
    oc, c = bits.shape
    t = x.shape[1]
    patterns = bits.reshape(oc * c)
    rows = np.empty(TILE_ROWS * c, np.float32)
    spare = np.empty(TILE_ROWS * TILE_COLUMNS, np.float32)
    for o in range(0, oc, TILE_ROWS):
        n = min(TILE_ROWS, oc - o)
        block = patterns[o * c:(o + n) * c]
        for i in range(block.size):
            rows[i] = half_to_float32(block[i])
        for i in range(n * c, TILE_ROWS * c):
            rows[i] = 0.0
        # the next block's rows, read ahead (on the last block, addresses past the end: a prefetch
        # there is dropped, never a fault)
        ahead = bits.ctypes.data + 2 * (o + TILE_ROWS) * c
        for j in range(0, t, TILE_COLUMNS):
            if n == TILE_ROWS:
                _tile_4x16(rows.ctypes.data, c, x.ctypes.data + 4 * j, t, out.ctypes.data + 4 * (o * t + j), t, c, ahead)
            else:
                _tile_4x16(rows.ctypes.data, c, x.ctypes.data + 4 * j, t, spare.ctypes.data, TILE_COLUMNS, c, ahead)
                for i in range(n):
                    for jj in range(TILE_COLUMNS):
                        out[o + i, j + jj] = spare[i * TILE_COLUMNS + jj]
            _finish(out, o, n, j, bias, limit)


_NO_BIAS = np.empty(0, np.float32)

# the products every generation calls, ready when the emulator is imported (`load_compiled`):
# weights are read-only blob payloads (decode's layers, prefill's tiles) or writable (the head)
_BITS, _BITS_RO = types.Array(types.uint16, 2, "C"), types.Array(types.uint16, 2, "C", readonly=True)
_F32, _F32_2 = types.Array(types.float32, 1, "C"), types.Array(types.float32, 2, "C")
load_compiled(matvec_fp16, (_BITS, _F32, _F32), (_BITS_RO, _F32, _F32))
load_compiled(narrow_times, (_BITS_RO, _F32_2, _F32_2, _F32, types.float64))
load_compiled(widen_into, (types.Array(types.uint16, 1, "C", readonly=True), _F32))


def half_times(bits: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
               limit: float | None = None) -> np.ndarray:
    """bits `[OC, C]` (fp16 patterns) times x `[N, C, T]`, plus bias (OC float32 values) and
    then the fp32 accumulator's limit (`saturate`): float32 `[N, OC, T]`. Up to NARROW columns
    (a multiple of 16), register tiles over rows widened four at a time (`narrow_times`), which
    add the bias and apply the limit in the same pass; wider, float32 BLAS over row blocks
    widened one at a time. Neither keeps a float32 copy of the whole matrix."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], bits.shape[0], x.shape[2]), np.float32)
    if x.shape[2] <= NARROW and x.shape[2] % TILE_COLUMNS == 0 and bits.flags.c_contiguous:
        b = _NO_BIAS if bias is None else np.ascontiguousarray(bias, np.float32).reshape(-1)
        for n in range(x.shape[0]):
            narrow_times(bits, x[n], out[n], b, math.inf if limit is None else float(limit))
        return out
    for r, w in widened_rows(bits):
        for n in range(x.shape[0]):
            np.dot(w, x[n], out=out[n, r:r + len(w)])
    if bias is not None:
        out += bias.reshape(-1, 1)
    return out if limit is None else saturate(out, limit)


def half_matvec(bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """bits `[OC, C]` (uint16 fp16 patterns) times x `[C]`: float32 `[OC]`, summed in float32."""
    out = np.empty(bits.shape[0], np.float32)
    matvec_fp16(bits, np.ascontiguousarray(x, np.float32), out)
    return out


class ResidentWeight:
    """A 1x1 conv weight `[OC, C, 1(, 1)]` held as its fp16 patterns for every evaluation: one
    column through `matvec_fp16`, a few (prefill) through register tiles, more through BLAS over
    row blocks widened one at a time (`half_times`), which measured as fast as one product with
    a float32 copy (module doc), so no float32 copy is ever kept. `values` are float32 fp16
    values (turned into patterns at the first evaluation, and dropped) or float16 (a BLOBFILE's
    bytes, viewed in place)."""

    def __init__(self, values: np.ndarray):
        self.shape = values.shape
        half = values.dtype == np.float16
        self.f32: np.ndarray | None = None if half else values
        self.f16: np.ndarray | None = values.reshape(self.shape[0], -1).view(np.uint16) if half else None
        self._lock = threading.Lock()

    def bits(self) -> np.ndarray:
        """The fp16 patterns `[OC, C]` (uint16)."""
        f16 = self.f16
        if f16 is None:
            with self._lock:
                if self.f16 is None:
                    self.f16, self.f32 = half_bits(self.f32.reshape(self.shape[0], -1)), None
                f16 = self.f16
        return f16

    def matvec(self, x: np.ndarray) -> np.ndarray:
        """W·x for one column x `[C]` as float32 `[OC]`."""
        return half_matvec(self.bits(), x)

    def times(self, x: np.ndarray, bias: np.ndarray | None = None, limit: float | None = None) -> np.ndarray:
        """W·x (+ bias, then the limit: `half_times`) for x `[N, C, T]` as float32 `[N, OC, T]`."""
        return half_times(self.bits(), x, bias, limit)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.f32, self.f16) if a is not None)


class ResidentConv:
    """conv's compute with a ResidentWeight in place of the weight operand, and the fp32
    accumulator's limit on the sum (bias included), as `emulator.accum.accumulated` applies it."""

    def __init__(self, weight: ResidentWeight, limit: float | None):
        self.weight, self.limit = weight, limit

    def __call__(self, x: dict, p: dict) -> list[np.ndarray]:
        v, bias = x["x"], x.get("bias")
        oc, one_column = self.weight.shape[0], v.shape[0] * math.prod(v.shape[2:]) == 1
        if not one_column and (bias is None or isinstance(bias, np.ndarray) and bias.size == oc):
            # prefill, training: the product over all columns at once, with its bias and limit
            out = self.weight.times(v.reshape(v.shape[0], v.shape[1], -1), bias, self.limit)
            return [out.reshape((v.shape[0], oc) + v.shape[2:])]
        if one_column:  # the decode path
            out = self.column(v)
        else:  # a bias that broadcasts
            out = self.weight.times(v.reshape(v.shape[0], v.shape[1], -1)).reshape((v.shape[0], oc) + v.shape[2:])
        out = out if bias is None else out + bias.reshape((1, -1) + (1,) * (v.ndim - 2))
        return [out if self.limit is None else saturate(out, self.limit)]

    def column(self, v: np.ndarray) -> np.ndarray:
        """The product of one column v `[1, C, 1(, 1)]` (a decode token's), without a bias or the limit."""
        return self.weight.matvec(v.reshape(-1)).reshape((1, -1) + (1,) * (v.ndim - 2))


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
    return held_conv(held, wkey, w, profile.accumulator_limit), [(k, v) for k, v in tensors if k != "weight"]


def held_conv(held: dict[str, ResidentWeight], wkey: str, w: np.ndarray, limit: float | None) -> ResidentConv:
    """The compute of a 1x1 conv on const `wkey` (values `w`: float32 or an fp16 blob view),
    its ResidentWeight made once in `held` for every conv that reads it."""
    if wkey not in held:
        held[wkey] = ResidentWeight(np.ascontiguousarray(w))
    return ResidentConv(held[wkey], limit)


# decoded 4-bit weights by their operands' content (emulator.builder's DECODED_WEIGHTS): a
# runner's prefill and decode programs decode the same blobs, each into a plan of its own, and
# without this each held its own copy (SmolLM2's W4 layers: 425 MB instead of 212)
_DECODED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_DECODING = threading.Lock()


def decoded_once(op: str, args: dict[str, np.ndarray], params: dict, decode: Callable[[], np.ndarray]) -> np.ndarray:
    """`decode()`'s read-only float16 weight, made once while any plan holds it for every fold of
    `op` on operands `args` of the same bytes with the same params (the result is a function of them)."""
    h = xxhash.xxh3_128(f"{op} {sorted(params.items())!r}".encode())
    for k, a in sorted(args.items()):
        a = np.ascontiguousarray(a)
        h.update(f"{k} {a.dtype} {a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    key = h.digest()
    with _DECODING:
        w = _DECODED.get(key)
    if w is None:
        w = decode()
        w.setflags(write=False)  # shared by plans
        with _DECODING:
            w = _DECODED.setdefault(key, w)
    return w


def _plain(p: dict[str, Any]) -> bool:
    """Params under which a 1x1 conv is one product over channels (ops_linear._conv2d's fast path)."""
    return int(p["groups"]) == 1 and p["pad_type"] in ("valid", "same", "same_lower") \
        and all(int(s) == 1 for s in as_list(p["strides"] or [1]))


class HalfMatrix:
    """A float matrix `[R, C]` held as fp16 patterns (half the memory of float32): indexing
    widens the rows it picks (an embedding lookup); `times` multiplies rows of activations."""

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
        for r, w in widened_rows(self.bits):
            out[:, r:r + len(w)] = x @ w.T
        return out
