"""W4: the 4-bit blocks of every linear (docs/quantization.md; the format is models/formats/quantized.py's).

From float weights each block of `block` inputs is put on 16 levels with fp16 scale and offset:
min..max (`quantize_blocks`, Q4_1's grid), or, given `moments` (each input channel's mean square
over calibration text, quant/lut.py's `input_moments`), fitted (`fit_blocks`): candidates of
scale (max − min)/(15 + δ) from the block's minimum, each refined by rounding onto its grid and
solving the least squares for (scale, minimum) at those levels, each weight's error counted by
its input's mean square (its share of the output's error); the least error is kept, min..max
being the first candidate, so weights already on a 4-bit grid come back as they are.
Measured on Gemma 3 270M (Q4_K_M GGUF: its linears are Q5_0, Q8_0, Q4_K and Q6_K, none taken
as they are), float32 CPU reference, 1024 tokens of the Apache license (four 256-token windows,
each from BOS) after the 256 that calibrate, perplexity ratios: min..max x1.259, fitted without
the moments x1.152, fitted with them x1.051 (x1.029 in blocks of 16; on the emulator, over the
256 tokens tests/quant/test_quantize_gemma3_4bit.py scores: x1.150 min..max, x1.010 fitted).
Without moments min..max stays: the unweighted fit gains less. `anelm quantize` fits when the
calibration has MOMENT_TOKENS: fewer give moments that the next text's differ from by up to 37x
in a channel (the tiny random Llama of tests/quant/test_quantize_w4.py, 64 tokens). On that model
(perplexity 1356 over 96 words) the fit lowers the weights' error (26.7 -> 20.9), the logits'
KL to the source (0.465 -> 0.411 nats) and their rms error (1.16 -> 1.09), yet moves its
perplexity ratio from x1.008 to x1.146: a ratio min..max puts anywhere from x0.84 to x1.26 on
eight other 64-token texts, noise at that perplexity, not a loss.

Tables (the embedding, an untied head): int8 blocks, unless with them the weights would stay
over TARGET of their fp16 size with every linear in 4-bit blocks of 32 (`w4_tables`): then 4-bit
blocks of TABLE_BLOCK, the table the head multiplies fitted on the head's input moments (the
final norm's output), which the row lookup reads too. Gemma 3 270M (tied, 168M of 268M weights):
int8 tables 45 %; in 4-bit blocks fitted so, float32 CPU on the test's 255 scored tokens,
x1.011 with the fitted linears (x1.009 with the int8 table; min..max blocks of it x1.066);
on the emulator x1.012, the folder 37.5 % (tests/quant/test_quantize_gemma3_4bit.py).
SmolLM2-135M's int8 tables leave it at 36 % (its GGUF's Q8_0 embedding, kept exactly).

From a GGUF whose linears are already 4-bit blocks of 32 (Q4_0, Q4_1) at `--block-size 32`, the
file's own blocks are taken, not requantized. From a GGUF of 4-bit blocks:

    Q4_0  w = d·(q − 8)   -> data q, scale d, offset 8 (a uint4 zero point): exact, the device's
                             dense weight fp16(d·(q − 8)) is the fp16 rounding of the GGUF's value
    Q4_1  w = d·q + m     -> data q, scale d, offset fp16(−m/d). No (scale, offset) makes the op's
                             fp16(d·fp16(q − offset)) equal fp16(d·q + m) for every q: −m/d is
                             rarely an fp16. What remains: the offset's rounding (half an fp16 step
                             of −m/d, a few 2^-8 of d for offsets under 16) and the fp16 rounding of
                             q − offset, each times d, beside the product's own rounding: a weight
                             moves by at most ~2 fp16 steps of its block's largest |w|
                             (tests/quant/test_quantize_w4_real.py measures the logits).
                             A block with d = 0 (all weights m) is data 0, scale 1, offset −m: exact.

Which linear came from which GGUF tensor is the loader's own map (`models.gguf._tensor_names`);
the rows llama.cpp permuted (Llama's q/k) are found by the architecture's own fix applied to
row numbers; and the blocks are taken only if they give back the loaded weights exactly (GGUF's
float32 d·q + m): anything else (another type, another block size, a layout we do not see
through) is requantized, and said.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..models.formats.quantized import BlockQuant, linear_names, quantize_blocks, table_names

GGUF_BLOCK = 32  # Q4_0 and Q4_1 blocks


STEPS = (0.0, 1.0, 2.0)  # δ: candidate scales (max − min)/(15 + δ)
ITERATIONS = 3  # rounding / least-squares rounds per candidate
FIT_ELEMENTS = 1 << 18  # weights `fit_blocks` takes at a time (1 MB each of its buffers)
MOMENT_TOKENS = 128  # fewer calibration tokens: min..max (module doc)
TARGET = 0.40  # W4's folder aim, of the fp16 weights (docs/quantization.md)
TABLE_BLOCK = 32  # the tables' 4-bit blocks where they are 4-bit (`w4_tables`)


def w4_blocks(config, weights: dict[str, np.ndarray], block: int, source: Path | None = None,
              moments: dict[str, np.ndarray] | None = None) -> tuple[dict[str, BlockQuant], dict[str, int]]:
    """({linear: its blocks}, {how: count}) where how is the GGUF type taken or "requantized";
    `moments`: {linear: its inputs' mean squares}: requantized blocks are fitted (module doc)."""
    names = linear_names(config)
    taken = gguf_blocks(source, config, weights) if source is not None and source.suffix == ".gguf" \
        and block == GGUF_BLOCK else {}
    blocks, how = {}, {}
    for n in names:
        kind, bq = taken.get(n, ("requantized", None))
        if bq is None:
            w = weights[n + ".weight"]
            bq = quantize_blocks(w, block) if moments is None else fit_blocks(w, block, moments[n])
        blocks[n] = bq
        how[kind] = how.get(kind, 0) + 1
    return blocks, how


def w4_tables(config, weights: dict[str, np.ndarray], moments: dict | None = None) -> dict:
    """{table: its 4-bit blocks of TABLE_BLOCK} where int8 tables would leave the weights above
    TARGET of their fp16 size even with the linears in 4-bit blocks of 32, else {} (module doc);
    fitted on the head's input moments where the table is what the head multiplies."""
    tables, lin = table_names(config, weights, TABLE_BLOCK), {n + ".weight" for n in linear_names(config)}
    size = {k: int(v.size) for k, v in weights.items()}
    int8 = sum((0.5 + 4 / 32) * n if k in lin else (1 + 2 / TABLE_BLOCK) * n if k in tables else 2 * n
               for k, n in size.items())
    if int8 <= TARGET * 2 * sum(size.values()):
        return {}
    return {k: quantize_blocks(weights[k], TABLE_BLOCK) if k not in (moments or {}) else
            fit_blocks(weights[k], TABLE_BLOCK, moments[k]) for k in tables}


def fit_blocks(w: np.ndarray, block: int, importance: np.ndarray | None = None) -> BlockQuant:
    """w [out, in] -> blocks of `block` inputs whose 16 levels are fitted (module doc), each
    weight counted by its input's `importance` [in] (or one a weight, [out, in]); scale and
    offset fp16, as `quantize_blocks`. Blocks are independent: rows go through in pieces of about
    FIT_ELEMENTS weights, which stay in the caches through the fit's rounds."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    a = np.ones(cols, np.float32) if importance is None else np.asarray(importance, np.float32) + 1e-12
    a = np.broadcast_to(a / a.mean(), w.shape)
    step = max(1, FIT_ELEMENTS // cols)
    shape = (-1, cols // block, block)
    parts = [_fit_rows(w[i:i + step].reshape(shape), a[i:i + step].reshape(shape)) for i in range(0, rows, step)]
    q, scale, offset = (np.concatenate(p) for p in zip(*parts))
    return BlockQuant(q.reshape(rows, cols), scale, offset)


def _fit_rows(wb: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels uint8, scale fp16, offset fp16) of the blocks wb [rows, blocks, block] with weights a."""
    lo, hi = wb.min(axis=2, keepdims=True), wb.max(axis=2, keepdims=True)
    span = np.maximum(hi - lo, np.float32(1e-30))
    sa, saw, saww = (np.sum(a * v, axis=2, keepdims=True) for v in (1, wb, wb * wb))
    q, aq, tmp = (np.empty_like(wb) for _ in range(3))  # reused by every round

    def level(s, m):  # each weight's level on the grid m + s·[0, 15], into q
        np.divide(np.subtract(wb, m, out=q), s, out=q)
        return np.clip(np.rint(q, out=q), 0, 15, out=q)

    best_s, best_m = span / 15, lo
    level(best_s, best_m)
    np.subtract(np.add(np.multiply(best_s, q, out=tmp), best_m, out=tmp), wb, out=tmp)
    best = np.multiply(a, np.square(tmp, out=tmp), out=tmp).sum(axis=2, keepdims=True)  # min..max: a 4-bit grid stays
    for d in STEPS:
        s, m = span / (15 + d), lo
        for _ in range(ITERATIONS):
            level(s, m)
            np.multiply(a, q, out=aq)
            saq = aq.sum(2, keepdims=True)
            saqq = np.multiply(aq, q, out=tmp).sum(2, keepdims=True)
            saqw = np.multiply(aq, wb, out=tmp).sum(2, keepdims=True)
            det = sa * saqq - saq * saq
            ok = det > 1e-6 * sa * saqq  # at least two levels used
            s_new = (sa * saqw - saq * saw) / np.where(ok, det, 1)
            ok &= s_new > 0
            s, m = np.where(ok, s_new, s), np.where(ok, (saw - s_new * saq) / sa, m)
            # the least squares' residual at these levels (rounding to the new grid only lowers it)
            e = np.where(ok, saww - s * saqw - m * saw, np.inf)
            better = e < best
            best, best_s, best_m = np.where(better, e, best), np.where(better, s, best_s), np.where(better, m, best_m)
    scale = best_s[:, :, 0].astype(np.float16)
    flat = (scale == 0) | (hi[:, :, 0] == lo[:, :, 0])  # a constant block: one level, its value
    scale[flat] = 1.0
    offset = np.where(flat, -lo[:, :, 0], -best_m[:, :, 0] / scale.astype(np.float32)).astype(np.float16)
    sc, of = scale.astype(np.float64)[:, :, None], offset.astype(np.float64)[:, :, None]
    return np.clip(np.round(wb / sc + of), 0, 15).astype(np.uint8), scale, offset


def gguf_blocks(path: Path, config, weights: dict[str, np.ndarray]) -> dict[str, tuple[str, BlockQuant]]:
    """{linear: (GGUF type, its blocks)} for the Q4_0/Q4_1 linears of a GGUF whose blocks give
    back the loaded weights exactly (module doc)."""
    import gguf

    from ..models.formats.gguf import _tensor_names  # the loader's HF name -> GGUF tensor map
    from ..models.loading import architecture

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    module = architecture(config.model_type)
    gnames = _tensor_names(arch, config, module.expected_shapes(config), tensors, path)
    lin = linear_names(config)
    rows = {n + ".weight": np.arange(weights[n + ".weight"].shape[0], dtype=np.float32)[:, None] for n in lin}
    fix = getattr(module, "gguf_weights", None)
    moved = module.unsanitize(fix(dict(rows), config) if fix else rows, config)
    out = {}
    for n in lin:
        t, perm = tensors.get(gnames.get(n + ".weight")), moved.get(n + ".weight")
        if t is None or t.tensor_type.name not in ("Q4_0", "Q4_1") or perm is None or perm.shape != rows[n + ".weight"].shape:
            continue
        bq = _blocks(np.asarray(t.data), t.tensor_type.name)
        if bq is None or bq.data.shape != weights[n + ".weight"].shape:
            continue
        bq = BlockQuant(*(a[perm[:, 0].astype(np.int64)] for a in (bq.data, bq.scale, bq.offset)))
        if np.array_equal(_gguf_value(bq, t.tensor_type.name, np.asarray(t.data), perm), weights[n + ".weight"]):
            out[n] = (t.tensor_type.name, bq)
    if len(out) < len(lin):
        print(f"anelm: note: {len(lin) - len(out)} of {len(lin)} linears of {path.name} are not Q4_0/Q4_1 "
              "blocks of 32 we can take as they are: those are requantized", file=sys.stderr)
    return out


def _split(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF rows of Q4_0 (d, 16 bytes) or Q4_1 (d, m, 16 bytes) blocks -> (q [rows, cols] uint8,
    d [rows, nb] fp16, m [rows, nb] fp16 or None). A block's 32 values: byte j's low nibble is
    value j, its high nibble value j + 16."""
    size = 18 if kind == "Q4_0" else 20
    r = raw.reshape(raw.shape[0], -1, size)
    d = np.ascontiguousarray(r[:, :, :2]).view(np.float16)[:, :, 0]
    m = np.ascontiguousarray(r[:, :, 2:4]).view(np.float16)[:, :, 0] if kind == "Q4_1" else None
    qs = r[:, :, size - 16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(raw.shape[0], -1)
    return q.astype(np.uint8), d, m


def _blocks(raw: np.ndarray, kind: str) -> BlockQuant | None:
    if raw.ndim != 2 or raw.shape[1] % (18 if kind == "Q4_0" else 20):
        return None
    q, d, m = _split(raw, kind)
    if m is None:
        return BlockQuant(q, d, np.full(d.shape, 8, np.uint8))
    zero = d == 0  # every weight is m: level 0 of scale 1 and offset −m
    scale = np.where(zero, np.float16(1), d).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        offset = np.where(zero, -m.astype(np.float32), -m.astype(np.float32) / d.astype(np.float32)).astype(np.float16)
    q = np.where(np.repeat(zero, GGUF_BLOCK, axis=1), np.uint8(0), q)
    return BlockQuant(q, scale, offset)


def _gguf_value(bq: BlockQuant, kind: str, raw: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """The loaded weight as the gguf package computes it from these blocks, in float32 (d·q + m
    or d·(q − 8)), rows in the loader's order: what the blocks must give back."""
    q, d, m = _split(raw, kind)
    idx = perm[:, 0].astype(np.int64)
    rep = lambda a: np.repeat(a[idx].astype(np.float32), GGUF_BLOCK, axis=1)  # noqa: E731
    if m is None:
        return rep(d) * (q[idx].astype(np.float32) - np.float32(8))
    return rep(d) * q[idx].astype(np.float32) + rep(m)
