"""The classifier and its cross-entropy on the device, one vocabulary tile per evaluation.

The head W `[V, D]` is cut into tiles of T rows (the last one may be shorter: its own program).
One evaluation of a tile, on the final-norm output x `[D, S]` of one sequence:

    l = W_t·x                    `[T, S]`  logits of the tile's rows
    m = max_rows l               `[1, S]`  the tile's max per position
    e = exp(l − m)               `[T, S]`  in (0, 1]: no fp16 overflow whatever the logits
    z = Σ_rows e                 `[1, S]`  ≤ T
    g = W_tᵀ·e                   `[D, S]`  the tile's share of dx, before its weight

The CPU joins the tiles (online softmax, as flash attention joins key blocks): with
lse = log Σ_t z_t·exp(m_t) per position and c_t = exp(m_t − lse), the softmax of the tile's
rows is e·c_t, so dx = Σ_t c_t·g_t − W[target] and dW_t = (e·c_t)·xᵀ − onehot·xᵀ (times the
loss scale over the count): one pass over the vocabulary, forward and backward together,
where a softmax needing the global max first would take two. The loss is lse − l[target],
the target's logit a dot product on the CPU.

Layout (as the layer kernels', `kernels.training`): one input `[1, D, 1, S + T]` holding x in
its first S columns and the tile's block M = W_tᵀ `[D, T]` after them, staged once per
optimizer update; y = Mᵀ·x and g = M·e are matmuls on slices of it, so one compile serves
every tile and every update. Outputs are declared alphabetically (the strict binding order).
"""

from __future__ import annotations

from ..chip.profile import padded_width
from ..ir.builder import GraphBuilder

OUTPUTS = ("dx", "e", "lmax", "lsum")


def input_width(d_seq: int, rows: int, multiple: int = 1) -> int:
    """Columns of the input: S activations, then the T columns of the block, padded."""
    return padded_width(d_seq + rows, multiple)


def classifier_tile(d: int, s: int, rows: int, multiple: int = 1):
    """The tile kernel for a head of width `d`, sequences of `s` columns and tiles of `rows`."""
    b = GraphBuilder(f"classifier_{rows}")
    inp = b.input("x", [1, d, 1, input_width(s, rows, multiple)])
    x = b.slice_by_size(inp, [0, 0, 0, 0], [1, d, 1, s], name="x_in")
    m = b.slice_by_size(inp, [0, 0, 0, s], [1, d, 1, rows], name="w_in")
    m4 = b.reshape(m, [1, 1, d, rows], name="w4")                         # M = W_tᵀ
    x4 = b.reshape(x, [1, 1, d, s], name="x4")
    logits = b.matmul(m4, x4, transpose_x=True, name="logits")          # [1, 1, T, S]
    lmax = b.reduce_max(logits, axes=(2,), name="lmax4")                # [1, 1, 1, S]
    e = b.exp(b.sub(logits, lmax, name="shifted"), name="e4")
    lsum = b.reduce_sum(e, axes=(2,), name="lsum4")
    dx = b.matmul(m4, e, name="g4")                                     # [1, 1, D, S]
    outs = {"dx": b.reshape(dx, [1, d, 1, s], name="dx_out"), "e": b.reshape(e, [1, rows, 1, s], name="e_out"),
            "lmax": b.reshape(lmax, [1, 1, 1, s], name="lmax_out"), "lsum": b.reshape(lsum, [1, 1, 1, s], name="lsum_out")}
    for name in OUTPUTS:
        b.output(name, outs[name])
    return b.build()
