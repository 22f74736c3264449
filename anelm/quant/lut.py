"""LUT4/LUT6: every linear palettized, one table of 2^bits fp16 values per tile of rows by inputs
(docs/quantization.md; the format is models/formats/quantized.py's `LutQuant`).

Each tile's values are clustered by Lloyd's k-means in one dimension, each weight counted by the
mean square of its input over the calibration text (`input_moments`: the output error a weight
makes is its error times its input). In one dimension Lloyd is cheap on sorted values: the
clusters are runs between the midpoints of neighbouring centroids, so an iteration is a search
of 2^bits − 1 midpoints and prefix sums' differences, for all tiles of a linear at once (each
tile's values shifted into its own interval of one sorted array). Deterministic, no seed: the
centroids start evenly spaced from the tile's least value to its largest (quantiles measured
worse: they leave the outliers no entry). The tables are rounded to fp16; the indices are taken
against those fp16 entries. lut4 given ORDER_TOKENS calibration tokens or more: in GPTQ's order
(quant/gptq.py: input column by input column, each weight's error moved onto the columns still
to come under its input's covariance), the moments then the diagonal of the same covariances;
else each weight takes its nearest entry (`palettize`), the best for one weight alone.

Tables (`--group-size` rows by up to `--block-size` inputs; constexpr_lut_to_dense tiles both
axes), chosen by measurement: SmolLM2-135M (Q4_1 GGUF), float32 CPU reference, 128 held-out
tokens of the Apache license after the 256 that calibrate, perplexity ratios:
    lut4, a table per row (576 or 1536 inputs)       x1.158 (x1.73 with quantile-started centroids,
                                                     x4.29 also without the input moments)
    lut4, a table per 16 rows                        x1.65
    lut4, a table per row and 192 / 96 / 64 inputs   x1.033 / x1.072 / x1.047 (unweighted)
    lut4, a table per row and 32 inputs              x1.0001: a Q4_1 block's 16 levels, found again
    lut6, a table per 16 rows / per row              x1.029 / x1.081 (quantile-started)
So lut4 takes a table per row and 192 inputs (the largest divisor of a linear's inputs up to
192): 0.5 + 32/192 = 0.67 bytes a weight, W4's 0.63 (on the emulator: x1.048, folder 104.6 MB =
39 % of the fp16 weights); lut6 a table per 16 rows of whole rows, 0.75 bytes a weight (x1.017,
114.7 MB = 43 %). A 4-bit table per whole row, what palettizers usually do, cannot hold this
small a model: 16 values for 576 weights spread by the norm gains and the outliers.
Row folds (kernels/int8.py) go into a tile's table when its rows share the factor.

lut4 without --block-size, given calibration text with a held-out part (w8a8.held_part: 512
tokens or more), chooses its tables per model as quant/w8a8.py chooses (`choose_block`): a table
per row and 192, then 64 inputs, the first whose perplexity there on the CPU reference stays
within LIMIT (docs/quantization.md's lut4 bound) of the unquantized model's, else the lesser.
Not 32: 16 fp16 entries per 32 weights make 1.5 bytes a weight, more than W8. Scored on the
calibration text itself instead (256 tokens, all of which calibrate), the choice misleads:
SmolLM2 there x1.244 at 192 inputs, which measures x1.048 on the next 128 tokens.

GPTQ's order (quant/gptq.py) for lut4 from ORDER_TOKENS on. Gemma 3 270M, its 255 Apache
tokens after the first 256 scored, 512 calibrating (the 256 after the window added): 64 inputs
chosen (the held-out part x1.062 at 192, x0.992 at 64), x1.033 on the emulator and on the
float32 CPU (x1.047 at 192 there), folder 312.0 MB = 58 % of the fp16 weights; each weight's
nearest entry, the same tables, x1.052 at 64 (x1.052-1.054 on the CPU for 512 to 2068
calibrating tokens) and x1.091 at 192. The held-out part calibrates too (the moments did already), so its figures
flatter; left out of the covariances (384 tokens), it scores x1.153 / x1.058 and the window
x1.093 / x1.043 at 192 / 64: fewer tokens cost more than the choice's bias, which here chooses
the same. Tables refitted on the weights as the walk moves them (as GPTQ refits its groups'
scales) flattered the held-out part more (x1.008 at 192, chosen; the window x1.058): kept as
k-means made them. Fewer tokens make GPTQ worse than the nearest entry, the covariance having
directions they never saw: SmolLM2, CPU, the 128 tokens above scored, the first 256 then the
license after them calibrating, lut4 (192 inputs) / lut6, nearest against GPTQ's order:
    256 tokens    x1.048 / x1.017   against   x1.187 / x1.029 (damped by 10 %, 100 %: x1.119 /
                                                            x1.058, x1.094 / x1.022)
    1024 tokens   x1.038 / x1.025   against   x1.040 / x1.050
    2048 tokens   x1.040 / x1.030   against   x1.026 / x1.026
`quantize` calibrates on 4096 tokens by default. lut6 (ORDERED) keeps the nearest entry: its
tables of 64 entries per 16 whole rows gained nothing from the order but at 2048 tokens (above),
and on Gemma 3 270M (512 tokens, CPU) it measured x1.070 against x1.056 for the nearest.
"""

from __future__ import annotations

import numpy as np

from ..models.errors import InputError
from ..models.formats.quantized import LutQuant, linear_names
from . import gptq

ITERATIONS = 40  # Lloyd steps at most: 300 measured no better (local optima, not unfinished runs)
DEFAULTS = {4: (1, 192), 6: (16, 1 << 30)}  # bits -> (rows, most inputs) a table spans (module doc)
CHOICES, LIMIT = (192, 64), 0.05  # lut4's tile inputs tried, coarsest first; its bound (module doc)
ORDER_TOKENS, ORDERED = 512, (4,)  # GPTQ's order from this many calibration tokens, for these bits (module doc)


def palettize(w: np.ndarray, bits: int, group: int, block: int, importance: np.ndarray | None = None) -> LutQuant:
    """w [out, in] -> its LutQuant: `kmeans_tables`, each weight given its nearest entry."""
    (out, inp), lut = w.shape, kmeans_tables(w, bits, group, block, importance)
    x = np.asarray(w, np.float64).reshape(out // group, group, inp // block, block).transpose(0, 2, 1, 3)
    idx = nearest(x.reshape(-1, group * block), lut.reshape(-1, lut.shape[2]))
    idx = idx.reshape(out // group, inp // block, group, block).transpose(0, 2, 1, 3)
    return LutQuant(idx.reshape(out, inp).astype(np.uint8), lut)


def kmeans_tables(w: np.ndarray, bits: int, group: int, block: int, importance: np.ndarray | None = None):
    """w [out, in] -> its fp16 tables [out/group, in/block, 2^bits], ascending: k-means of 2^bits
    centroids per tile of `group` rows by `block` inputs, each weight counted by its input's
    `importance` [in] (its mean square)."""
    (out, inp), k = w.shape, 2 ** bits
    tiles = lambda a: np.ascontiguousarray(np.broadcast_to(a, w.shape).reshape(  # noqa: E731
        out // group, group, inp // block, block).transpose(0, 2, 1, 3)).reshape(-1, group * block)
    x = tiles(np.asarray(w, np.float64))  # [tiles, n]
    ng, n = x.shape
    a = tiles(np.ones(inp) if importance is None else np.asarray(importance, np.float64) + 1e-12)
    order = np.argsort(x, axis=1)
    srt, a = np.take_along_axis(x, order, 1), np.take_along_axis(a, order, 1)
    lo, span = srt[:, :1], np.maximum(srt[:, -1:] - srt[:, :1], 1e-30)
    base = 4.0 * np.arange(ng)[:, None]  # group g's values normalized into [4g, 4g + 1]
    flat = ((srt - lo) / span + base).reshape(-1)
    zero = np.zeros((ng, 1))
    csum, cw = (np.concatenate([zero, np.cumsum(v, axis=1)], axis=1) for v in (srt * a, a))
    cent = srt[:, :1] + (srt[:, -1:] - srt[:, :1]) * np.arange(k) / (k - 1)  # evenly min..max (module doc)
    edges, rows = np.full((ng, k + 1), -1), np.arange(ng)[:, None]  # rows: the tiles still moving
    for _ in range(ITERATIONS):
        c = cent[rows[:, 0]]
        mids = ((c[:, 1:] + c[:, :-1]) / 2 - lo[rows[:, 0]]) / span[rows[:, 0]] + base[rows[:, 0]]
        b = np.searchsorted(flat, mids.reshape(-1)).reshape(len(rows), k - 1) - n * rows
        b = np.concatenate([np.zeros((len(rows), 1), np.int64), b, np.full((len(rows), 1), n)], axis=1)
        moved = (b != edges[rows[:, 0]]).any(axis=1)  # a tile whose clusters stay has converged
        rows, b, c = rows[moved], b[moved], c[moved]
        if not len(rows):
            break
        edges[rows[:, 0]], mass = b, cw[rows, b[:, 1:]] - cw[rows, b[:, :-1]]
        sums = csum[rows, b[:, 1:]] - csum[rows, b[:, :-1]]
        cent[rows[:, 0]] = np.where(mass > 0, sums / np.where(mass > 0, mass, 1), c)  # an empty cluster stays
    return np.sort(cent.astype(np.float16), axis=1).reshape(out // group, inp // block, k)


def nearest(x: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """Each value's index of the nearest entry of its group's ascending table (ties low)."""
    t = lut.astype(np.float64)
    lo, span = t[:, :1], np.maximum(t[:, -1:] - t[:, :1], 1e-30)
    base = 4.0 * np.arange(len(t))[:, None]
    mids = ((t[:, 1:] + t[:, :-1]) / 2 - lo) / span + base
    pos = np.searchsorted(mids.reshape(-1), ((np.clip(x, t[:, :1], t[:, -1:]) - lo) / span + base).reshape(-1),
                          side="left")
    return pos.reshape(x.shape) - (t.shape[1] - 1) * np.arange(len(t))[:, None]


def tile_inputs(inp: int, most: int) -> int:
    """Inputs a table spans: the largest divisor of the linear's inputs up to `most`."""
    return max(d for d in range(1, min(inp, most) + 1) if inp % d == 0)


def lut_tables(config, weights: dict[str, np.ndarray], bits: int, group: int, block: int,
               calib=None, seq: int = 512) -> dict[str, LutQuant]:
    """{linear: its LutQuant}: tables of `group` rows by up to `block` inputs (`tile_inputs`).
    Given calibration ids `calib`, the k-means counts each weight by its input's mean square
    over them, and for lut4 from ORDER_TOKENS on the indices follow GPTQ's order under the
    inputs' covariance (quant/gptq.py), else each weight takes its nearest entry; without
    calibration, unweighted tables."""
    names = _checked(config, weights, bits, group)
    if bits in ORDERED and calib and len(calib) >= ORDER_TOKENS:
        return ordered_tables(config, weights, calib, seq, [(bits, group, block)])[0]
    moments = input_moments(config, weights, calib, seq) if calib else {}
    return {n: palettize(weights[n + ".weight"], bits, group, tile_inputs(weights[n + ".weight"].shape[1], block),
                         moments.get(n)) for n in names}


def _checked(config, weights: dict[str, np.ndarray], bits: int, group: int) -> list[str]:
    """The linears' names, once `group` rows and `bits` fit every linear (else one InputError)."""
    names = linear_names(config)
    bad = sorted({weights[n + ".weight"].shape[0] for n in names if weights[n + ".weight"].shape[0] % group})
    if bad:
        raise InputError(f"--group-size {group} does not divide every linear's rows ({bad}): expected a "
                         f"divisor of each, such as 1 or 16")
    if any(weights[n + ".weight"].shape[1] * bits % 8 for n in names):
        raise InputError(f"lut{bits}: every linear's inputs times {bits} bits must fill whole bytes")
    return names


def choose_block(config, weights: dict[str, np.ndarray], group: int, ids, seq: int, calib):
    """lut4's tile inputs, chosen (module doc): (inputs, the tables, {inputs: perplexity ratio of
    `ids` on the CPU reference}) for the first of CHOICES within LIMIT, else the least ratio;
    the tables built on the calibration ids `calib` (`lut_tables`), every choice's in one walk
    of the covariances where they are GPTQ's."""
    from .smooth import score

    if _checked(config, weights, 4, group) and 4 in ORDERED and calib and len(calib) >= ORDER_TOKENS:
        built = dict(zip(CHOICES, ordered_tables(config, weights, calib, seq, [(4, group, b) for b in CHOICES])))
    else:
        built = {b: lut_tables(config, weights, 4, group, b, calib, seq) for b in CHOICES}
    source, tried = score(config, weights, ids, seq), {}
    for block in CHOICES:
        dense = {n + ".weight": lq.dense() for n, lq in built[block].items()}
        tried[block] = score(config, {**weights, **dense}, ids, seq) / source
        if tried[block] <= 1 + LIMIT:
            return block, built[block], tried
    block = min(tried, key=tried.get)
    return block, built[block], tried


def input_moments(config, weights: dict[str, np.ndarray], ids, seq_len: int) -> dict[str, np.ndarray]:
    """{HF linear: the mean square of each input channel} over windows of `ids`, from the CPU
    reference (every projection's input, as quant/calibrate.py sees it), and the head's input
    (the final norm's output) under the weight the head multiplies (the embedding when tied)."""
    from ..models.loading import build_model
    from ..models.names import layer_prefix

    model, acc = build_model(config, weights), {}
    plain = model.project

    def project(i: int, name: str, x: np.ndarray) -> np.ndarray:
        key = layer_prefix(config.model_type, i) + name
        s, n = acc.get(key, (0.0, 0))
        acc[key] = (s + (np.asarray(x, np.float64) ** 2).sum(axis=0), n + len(x))
        return plain(i, name, x)

    def head(x: np.ndarray) -> np.ndarray:  # the head's input, every position, under its weight's name
        y = np.asarray(model.final_norm(x), np.float64)
        s, n = acc.get(model.head_name, (0.0, 0))
        acc[model.head_name] = (s + (y ** 2).sum(axis=0), n + len(y))
        return y[-1:]

    model.project, model.head = project, head
    for i in range(0, len(ids), seq_len):
        model.prefill(list(ids[i:i + seq_len]), model.new_cache())
    return {k: s / n for k, (s, n) in acc.items()}


def ordered_tables(config, weights: dict, ids, seq: int, specs: list[tuple[int, int, int]]) -> list[dict]:
    """For each (bits, rows, most inputs) of `specs`, {linear: its LutQuant}: k-means tables
    counted by the input moments (the diagonal of H over the tokens), indices in GPTQ's order
    (quant/gptq.py: the covariances a chunk of layers at a time, each H's factor and walk)."""
    names, stream, out, layers = linear_names(config), {}, [{} for _ in specs], config.num_hidden_layers
    per = len(names) // layers  # linear_names: layer by layer
    size = [sum(8 * weights[n + ".weight"].shape[1] ** 2 for n in names[i * per:(i + 1) * per]) for i in range(layers)]
    start = 0
    while start < layers:
        stop = start + 1
        while stop < layers and sum(size[start:stop + 1]) <= gptq.CHUNK_BYTES:
            stop += 1
        acc, alias, tokens = gptq.covariances(config, weights, ids, seq, range(start, stop), stream)
        for key in list(acc):
            h = acc.pop(key)
            members = [key] + [n for n, k in alias.items() if k == key]
            ws = [weights[n + ".weight"] for n in members]
            moments, u, w = np.diagonal(h) / tokens, gptq.factor(h), np.concatenate(ws)
            for (bits, group, most), got in zip(specs, out):
                block = tile_inputs(w.shape[1], most)
                luts = [kmeans_tables(x, bits, group, block, moments) for x in ws]  # each linear's own tables
                idx = np.split(gptq.walk(w, np.concatenate(luts), u), np.cumsum([len(x) for x in ws])[:-1])
                got.update({n: LutQuant(i, lut) for n, i, lut in zip(members, idx, luts)})
        start = stop
    return out
