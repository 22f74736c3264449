"""The classifier and its loss on the device, in vocabulary tiles (`kernels/classifier.py`).

    head = DeviceHead(device, vocab, d, seq_len, kernel_width, tile_rows(vocab, kernel_width))
    head.set_weights(W)                                    # W [V, D]: every tile restaged
    loss, dxf, dw_call = head.loss_and_grads(xf, targets, scale, count, want_dw, out, add)

Same contract as `cpu_ops.head_loss` (loss over the counted targets, gradients times the loss
scale, dW as a call the step's worker runs), computed as the kernel's module doc joins the
tiles: the device does the logits, their exp and row reductions, and dx per tile; the CPU
adds the tiles' shares (per-position weights c_t = exp(m_t − lse)), the target's logit and
one-hot terms, and dW = Σ_t (e_t·c_t)·xᵀ, the tile's rows of the gradient written in place.

Tiles are `tile_rows` rows (below); the cost model charges the same tiles (train/steps/placement.py).
"""

from __future__ import annotations

import warnings

import numpy as np

from ...compiler.passes.validate import MAX_DIM
from ...compiler.pipeline import compile_graph
from ...errors import ShapeError
from ...fp16.grid import round_fp16
from ...kernels.classifier import OUTPUTS, classifier_tile
from ...runtime.kernel import Kernel
from . import cpu_ops as ops
from .gemm import dw_into

F32 = np.float32
ROW_STEP = 512
# Few large tiles: a tile's fixed costs (its dispatch, x in and dx out, the CPU's join of its
# dx) are per tile, while the exp and the row reductions, which dominate its device time, are
# per logit; the ANE's matmuls slow ~30 % past the working set, a small share here. At most
# 8192 rows keeps a tile's sum of exps (≤ T) far under the fp16 accumulator's 32768.
MAX_ROWS = 8192


def tile_rows(vocab: int, s: int) -> int:
    """Rows per tile: the most, a multiple of ROW_STEP up to MAX_ROWS, whose input (S + T columns)
    stays within the compiler's dimension limit; the whole vocabulary when it is smaller."""
    return min(vocab, MAX_ROWS, (MAX_DIM - s) // ROW_STEP * ROW_STEP)


def tiles(vocab: int, rows: int) -> list[slice]:
    return [slice(lo, min(vocab, lo + rows)) for lo in range(0, vocab, rows)]


class DeviceHead:
    """One request per tile, each holding its tile's weights (staged in `set_weights`)."""

    def __init__(self, device, vocab: int, d: int, seq_len: int, width: int, rows: int):
        self.s, self.width, self.d = seq_len, width, d
        self.tiles = tiles(vocab, rows)
        multiple = device.profile.spatial_multiple_of
        self._kernels = {}
        for n in dict.fromkeys(t.stop - t.start for t in self.tiles):  # full tiles, and the last one
            with warnings.catch_warnings():  # a tile is past the SRAM working set by design (above)
                warnings.simplefilter("ignore")
                art = compile_graph(classifier_tile(d, width, n, multiple), device.profile)
            assert [o.name for o in art.signature.outputs] == list(OUTPUTS)
            self._kernels[n] = Kernel(art, device, float32_outputs=True, warn_overflow=False)
        self._req = [self._kernels[t.stop - t.start].request() for t in self.tiles]
        self.flops = sum(4 * d * (t.stop - t.start) * width for t in self.tiles)

    def set_weights(self, head: np.ndarray) -> None:
        w = round_fp16(np.asarray(head, F32))
        for req, t in zip(self._req, self.tiles):
            req.write("x", w[t].T, columns=slice(self.width, self.width + t.stop - t.start), exact=True)

    def close(self) -> None:
        for k in self._kernels.values():
            k.close()
        self._kernels.clear()
        self._req.clear()

    def _run(self, xf: np.ndarray):
        """Per tile, over every sequence: (g `[D, N]`, e `[T, N]`, m `[N]`, z `[N]`)."""
        s, n = self.s, xf.shape[1]
        out = []
        for req, t in zip(self._req, self.tiles):
            rows = t.stop - t.start
            g, e, m, z = np.empty((self.d, n), F32), np.empty((rows, n), F32), np.empty(n, F32), np.empty(n, F32)
            for lo in range(0, n, s):
                req.write("x", xf[:, lo:lo + s], columns=slice(0, s), saturate=True)  # ±65504, not inf
                r = req.run()
                cols = slice(lo, lo + s)
                g[:, cols], e[:, cols] = r["dx"][0, :, 0, :s], r["e"][0, :, 0, :s]
                m[cols], z[cols] = r["lmax"].reshape(-1)[:s], r["lsum"].reshape(-1)[:s]
            out.append((g, e, m, z))
        return out

    def loss_and_grads(self, head: np.ndarray, xf: np.ndarray, targets: np.ndarray, scale: float = 1.0,
                       count: int | None = None, want_dw: bool = True, out: np.ndarray | None = None,
                       add: bool = False):
        """(loss, dxf `[D, N]`, a call giving dW `[V, D]` or None): `cpu_ops.head_loss`'s contract
        (`head` is the CPU's float32 W, for the targets' rows and dW's shape)."""
        t = np.asarray(targets).reshape(-1)
        n = xf.shape[1]
        if n % self.s or t.shape[0] != n:
            raise ShapeError(f"device head: expected [D, B*{self.s}] positions and as many targets, "
                             f"got {list(xf.shape)} and {t.shape[0]}")
        keep = t != ops.IGNORE
        tk = np.where(keep, t, 0)
        count = int(keep.sum()) if count is None else count
        k = F32(scale) / F32(max(count, 1))
        parts = self._run(xf)
        mx = np.max([m for _, _, m, _ in parts], axis=0)
        lse = mx + np.log(np.sum([z * np.exp(m - mx) for _, _, m, z in parts], axis=0, dtype=F32))
        target_logit = np.einsum("nd,dn->n", head[tk], xf)
        loss = float(np.sum((lse - target_logit)[keep], dtype=np.float64) / max(count, 1))
        weights = [np.exp(m - lse) * keep * k for _, _, m, _ in parts]  # c_t, times scale/count
        dxf = -k * head[tk].T * keep
        for (g, _, _, _), c in zip(parts, weights):
            dxf += g * c
        if not want_dw:
            return loss, dxf, None

        def dw():
            buf = np.empty(head.shape, F32) if out is None else out
            for (_, e, _, _), c, rows in zip(parts, weights, self.tiles):
                dw_into(buf[rows], e, xf * c, add and out is not None)
            ops.embed_bwd(-k * xf * keep, tk, buf)  # the one-hot term of each counted target
            return buf
        return loss, dxf, dw
