"""Table indices in GPTQ's order (Frantar et al. 2022, with quant/lut.py's k-means tables kept).

A linear's output error on the calibration text is Σ_t ((w − q)·x_t)², the weight error under
H = Σ xᵀx, its input's covariance. The nearest table entry minimises each weight's own error and
ignores the correlations between inputs; GPTQ walks the inputs in order, gives each column of
weights its nearest entry (each row's own table for that column's tile) and moves the error,
divided by the Cholesky diagonal of H⁻¹, onto the columns still to come, which the inputs'
correlations let absorb it. The lazy blocks of LAZY columns make that a GEMM per block; within
a block the rows are one vector. H is damped by DAMP of its mean diagonal (GPTQ's 1 %); a dead
input (H_jj = 0) gets H_jj = 1, so its column pushes and takes no error: its nearest entry.
lut4 takes it from lut.ORDER_TOKENS calibration tokens on, lut6 never (lut.py's module doc has
the measurements: fewer tokens and lut6's whole-row tables did worse than the nearest entry).

The covariances come from the CPU reference over the calibration text, each linear's input as
the kernels see it (`model.project`, as lut.input_moments), one H per distinct input: q, k and
v share one, gate and up another, and their stacked rows are walked as one matrix. Layers are
taken in chunks of about CHUNK_BYTES of H: each chunk's pass runs the model up to the chunk's
last layer, the layers before it replaced by the stream the previous chunk saved, so the chunks
together cost one pass and the peak memory is one chunk's (Gemma 3 270M's would be 870 MB of
float64 H all at once, about 100 MB a chunk of two layers). The tied head/embedding is no table
(lut's linears are the layers' projections).

Cost, Gemma 3 270M, 512 calibrating tokens, one BLAS thread while another process held the
second core: `build_folder` lut4 (both candidates built, each scored on the held-out part)
74-89 s in two runs, against 73-77 s with the nearest entries (the covariances' pass replaces
the moments' one), peak memory 5.4 GB against 5.8 (the model's scoring sets it); per
layer, the four H factored in 0.19 s, the walk 0.4 s a table size (gate and up stacked: 0.16 s).
A walk column by column without the lazy blocks' GEMMs, a prototype, took 130-150 s a table
size. OpenBLAS's two threads under that load made the build 2x slower (162 s against 79 s
with the nearest entries): they wait on each other in the factorizations' mid-sized GEMMs.
"""

from __future__ import annotations

import numpy as np


DAMP, LAZY = 0.01, 128  # H's damping (of its mean diagonal); columns a GEMM update carries
CHUNK_BYTES = 160 << 20  # float64 H a chunk of layers collects at most (one layer always)


def assign(w: np.ndarray, lut: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Indices [out, in] (uint8) of w [out, in] into its tiles' fp16 tables `lut` [out/G, in/B, k]
    (ascending), in GPTQ's order under the input covariance h [in, in] (module doc)."""
    return walk(w, lut, factor(h))


def factor(h: np.ndarray) -> np.ndarray:
    """H damped (a dead input alone, module doc) -> the upper Cholesky factor of its inverse."""
    h = np.array(h, np.float64)
    d = np.diagonal(h).copy()
    d[d == 0] = 1.0
    h[np.diag_indices(len(h))] = d + DAMP * d.mean()
    return np.ascontiguousarray(inverse_cholesky(h))


def walk(w: np.ndarray, lut: np.ndarray, u: np.ndarray) -> np.ndarray:
    """`assign` given u, `factor`'s result (one u serves every table size)."""
    (out, inp), (ng, nb) = w.shape, lut.shape[:2]
    group, block = out // ng, inp // nb
    wt = np.ascontiguousarray(np.asarray(w, np.float32).T)  # [in, out]: a column of weights, a contiguous row
    idx = np.empty((inp, out), np.uint8)
    rows = np.arange(out)
    for b0 in range(0, inp, LAZY):
        b1 = min(b0 + LAZY, inp)
        err = np.empty((b1 - b0, out), np.float32)
        for c in range(b0, b1):
            if c == b0 or c % block == 0:  # this tile column's tables, one per row, and their midpoints
                t = np.repeat(lut[:, c // block].astype(np.float64), group, axis=0)  # [out, k]
                mids, vals = (t[:, 1:] + t[:, :-1]) / 2, t.astype(np.float32)
            col = wt[c]
            i = (col[:, None] > mids).sum(axis=1)  # the nearest entry, ties low (lut.nearest)
            idx[c] = i
            e = (col - vals[rows, i]) / u[c, c]
            wt[c + 1:b1] -= u[c, c + 1:b1, None] * e
            err[c - b0] = e
        wt[b1:] -= u[b0:b1, b1:].T @ err
    return idx.T.copy()


def inverse_cholesky(h: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor u of h⁻¹ (h⁻¹ = uᵀu), float32: with l the lower factor of h
    with its rows and columns reversed, u is l⁻¹ reversed. By halves, so that the work is GEMMs:
    numpy's cholesky and inv (OpenBLAS's threaded LAPACK) took 3.4 and 1.3 s for a 2048² H on
    this 2-core machine while another process ran, and 26-42 ms for each 128² block; this 0.09 s
    in float32 (0.5-0.9 in float64). float32 as GPTQ computes it: on Gemma 3 270M's layer 3 down
    and q (damped), 3e-4 of u's largest entry from float64's, 0.2 % / 0.007 % of the indices
    moved. float64 where float32 breaks down."""
    rev = h[::-1, ::-1]
    u = _cholesky(np.array(rev, np.float32))[1]
    if not np.isfinite(u).all():
        u = _cholesky(np.array(rev, np.float64))[1].astype(np.float32)
    return u[::-1, ::-1]


def _cholesky(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(l, l⁻¹), l lower with a = l lᵀ. By halves: [[a, bᵀ], [b, c]] gives l11 = chol(a),
    l21 = b l11⁻ᵀ, l22 = chol(c − l21 l21ᵀ), and l⁻¹'s lower left −l22⁻¹ l21 l11⁻¹."""
    n = len(a)
    l, inv = np.zeros_like(a), np.zeros_like(a)
    if n <= 16:  # column by column, then forward substitution
        for j in range(n):
            l[j, j] = np.sqrt(a[j, j] - l[j, :j] @ l[j, :j])
            l[j + 1:, j] = (a[j + 1:, j] - l[j + 1:, :j] @ l[j, :j]) / l[j, j]
        for j in range(n):
            inv[j, :j] = -(l[j, :j] @ inv[:j, :j]) / l[j, j]
            inv[j, j] = 1 / l[j, j]
        return l, inv
    m = n // 2
    l[:m, :m], inv[:m, :m] = _cholesky(a[:m, :m])
    l[m:, :m] = a[m:, :m] @ inv[:m, :m].T
    l[m:, m:], inv[m:, m:] = _cholesky(a[m:, m:] - l[m:, :m] @ l[m:, :m].T)
    inv[m:, :m] = -inv[m:, m:] @ (l[m:, :m] @ inv[:m, :m])
    return l, inv


def covariances(config, weights: dict, ids, seq: int, layers: range, stream: dict) -> tuple[dict, dict, int]:
    """({HF linear: Σ xᵀx of its input, float64}, {linear: the linear whose H it shares}, tokens)
    for `layers`, over windows of `ids` on the CPU reference. `stream` {window: the residual
    stream entering layers.start} is read, and updated to the stream after layers.stop − 1."""
    from ..models.loading import build_model
    from ..models.names import layer_prefix

    model, acc, alias, last = build_model(config, weights), {}, {}, {}
    plain_project, plain_block = model.project, model.block

    def project(i: int, name: str, x: np.ndarray) -> np.ndarray:
        key = layer_prefix(config.model_type, i) + name
        if last.get("x") is x:  # the same input as the previous linear's (q, k, v; gate, up)
            alias[key] = last["key"]
        else:
            x32 = np.asarray(x, np.float32)
            acc[key] = acc.get(key, 0.0) + (x32.T @ x32).astype(np.float64)
            last.update(x=x, key=key)
        return plain_project(i, name, x)

    def block(i: int, x: np.ndarray, rope, cache) -> np.ndarray:
        if i < layers.start:  # computed by an earlier chunk: its saved stream, entering layers.start
            return stream[window] if i == layers.start - 1 else x
        y = plain_block(i, x, rope, cache)
        if i == layers.stop - 1:
            stream[window] = y
            raise _Done
        return y

    model.project, model.block, tokens = project, block, 0
    for window, s in enumerate(range(0, len(ids), seq)):
        try:
            model.prefill(list(ids[s:s + seq]), model.new_cache())
        except _Done:
            pass
        tokens += len(ids[s:s + seq])
    return acc, alias, tokens


class _Done(Exception):
    """The chunk's last layer is done: the rest of the model is not run."""
