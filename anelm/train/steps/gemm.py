"""dW = dy·xᵀ written or added straight into a gradient buffer: one BLAS call, no temporary.

Gradient accumulation over micro-batches used to be a product into a new array and then a
pass `acc += g` over every parameter (12 bytes each, per micro-batch). BLAS's sgemm takes
C ← α·A·B + β·C, so with β = 1 the product lands in the accumulator as it is computed, and the
first micro-batch's β = 0 needs no zeroed buffer either. numpy has no call with β, so this
reaches the sgemm of the BLAS numpy itself loaded (threadpoolctl names the library; the same
one whose threads `runtime.threads` limits). Where that BLAS is not an OpenBLAS whose symbols
we know (Accelerate on a Mac), the product goes through numpy and is added after it.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

F32 = np.float32
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@lru_cache(maxsize=1)
def _sgemm():
    """(cblas_sgemm, its integer type), or None where numpy's BLAS is not one we can call."""
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("internal_api") != "openblas" or not lib.get("filepath"):
            continue
        try:
            so = ctypes.CDLL(lib["filepath"])
        except OSError:
            continue
        # scipy-openblas (numpy's wheels) prefixes and suffixes its symbols; ILP64 when "64"
        for name, integer in (("scipy_cblas_sgemm64_", ctypes.c_int64), ("scipy_cblas_sgemm", ctypes.c_int),
                              ("cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm", _plain_int(so))):
            fn = getattr(so, name, None)
            if fn is not None and integer is not None:
                fn.restype = None
                return fn, integer
    return None


def _plain_int(so):
    """The integer width of an unsuffixed OpenBLAS (its config names USE64BITINT), or None."""
    config = getattr(so, "openblas_get_config", None)
    if config is None:
        return None
    config.restype = ctypes.c_char_p
    return ctypes.c_int64 if b"USE64BITINT" in (config() or b"") else ctypes.c_int


def _rows(a: np.ndarray) -> np.ndarray:
    """`a` as BLAS reads a row-major matrix: float32, unit stride along each row."""
    if a.dtype == F32 and a.strides[1] == 4 and a.strides[0] >= 4 * a.shape[1] and a.strides[0] % 4 == 0:
        return a
    return np.ascontiguousarray(a, dtype=F32)


def dw_into(out: np.ndarray, dy: np.ndarray, x: np.ndarray, add: bool) -> np.ndarray:
    """out ← dy·xᵀ (add False) or out += dy·xᵀ (add True); out `[M, N]` C-contiguous float32,
    dy `[M, K]`, x `[N, K]`. Returns out."""
    m, k = dy.shape
    n = x.shape[0]
    if out.shape != (m, n) or x.shape[1] != k or out.dtype != F32 or not out.flags.c_contiguous:
        raise ValueError(f"dw_into: expected out [{m}, {n}] C-contiguous float32 for dy {list(dy.shape)} "
                         f"and x {list(x.shape)}, got {list(out.shape)} {out.dtype}")
    blas = _sgemm()
    if blas is None or 0 in (m, n, k):
        if add:
            out += dy @ x.T
        else:
            np.matmul(dy, x.T, out=out)
        return out
    fn, i = blas
    a, b = _rows(dy), _rows(x)
    ptr = lambda arr: arr.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    fn(i(_ROW_MAJOR), i(_NO_TRANS), i(_TRANS), i(m), i(n), i(k), ctypes.c_float(1.0),
       ptr(a), i(a.strides[0] // 4), ptr(b), i(b.strides[0] // 4), ctypes.c_float(1.0 if add else 0.0),
       ptr(out), i(n))
    return out


def fold_into(grads: dict[str, np.ndarray], into: dict[str, np.ndarray] | None, add: bool) -> dict:
    """The gradients a step made outside the GEMMs (norms, biases, LoRA's adapters) written or
    added into their buffers too; the buffers by name (the step's gradients as `into` holds them)."""
    if into is None:
        return grads
    for n, g in grads.items():
        buf = into[n]
        if g is not buf:
            if add:
                buf += g
            else:
                buf[...] = g
    return {n: into[n] for n in grads}
