"""Teacher-forced scoring of a text (docs/models.md): what tells whether a model, a quantization
or a fine-tune is right.

    score = perplexity(runner, ids, seq_len=512)
    score.ppl, score.nll, score.argmax

The ids are cut into consecutive windows of `seq_len`; each window is scored on its own from an
empty cache (one prefill, logits at every position), so a window never sees the text before it,
as in HF's and llama.cpp's fixed-window perplexity. A last window shorter than 2 tokens has
nothing to predict and is dropped.

Instruction data (docs/fine-tuning.md) is scored record by record, each from an empty cache, in the
same windows, counting only the targets a mask marks (an answer, a completion):

    score = score_records(runner, [(line, ids, counted), ...], seq_len=512)
    score.records[0].nll
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..models.errors import InputError

# Without a terminal (a log file, a pipe) there is no bar: a line this often instead, so a cold
# run (programs built in its first windows, minutes on a real model) is never long silent.
NOTICE_EVERY_S = 10.0
NLL_BLOCK_ELEMENTS = 1 << 21  # token_nll's float64 block: 16 MB, reused from the heap


@dataclass(frozen=True)
class Score:
    tokens: list[int]  # the evaluated ids (the windows, concatenated)
    windows: int
    predictions: int  # next-token predictions scored: every position of a window but its last
    nll: float  # mean negative log-likelihood, nats
    argmax: list[int]  # each window's argmax next-token id at every position but its last
    records: list[RecordScore] | None = None  # per record, for instruction data

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


@dataclass(frozen=True)
class RecordScore:
    line: int  # the record's line in its file
    tokens: int  # its tokens that were scored (the windows, concatenated)
    predictions: int  # its counted predictions
    nll: float | None  # their mean nll, nats; None when it has none


def windows(ids: Sequence[int], seq_len: int) -> list[list[int]]:
    """Consecutive windows of `seq_len` ids; a last one shorter than 2 is dropped."""
    if seq_len < 2:
        raise InputError(f"--seq-len {seq_len} is too short: expected at least 2 tokens per window")
    cut = [list(ids[i:i + seq_len]) for i in range(0, len(ids), seq_len)]
    return [w for w in cut if len(w) >= 2]


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64 (a 49k-way log-sum-exp in float32 loses
    the digits that a perplexity ratio of 1.001 is judged on). A few rows at a time: float64
    copies of a whole window's logits (Gemma: 255 rows of 262k, 535 MB each) cost more in fresh
    pages than the arithmetic (2-10 s a window inside a large process, against 0.3 s), and a
    row-major block also reads logits that lie transposed along their rows."""
    z = np.asarray(logits)
    out = np.empty(len(z))
    step = max(1, NLL_BLOCK_ELEMENTS // max(1, z.shape[1]))
    for i in range(0, len(z), step):
        block = np.array(z[i:i + step], dtype=np.float64, order="C")
        m = block.max(axis=1)
        picked = block[np.arange(len(block)), targets[i:i + step]]
        block -= m[:, None]
        out[i:i + step] = np.log(np.exp(block, out=block).sum(axis=1)) + m - picked
    return out


def perplexity(runner: Any, ids: Sequence[int], seq_len: int, progress: bool | None = None) -> Score:
    """Score `ids` with `runner` (anelm.generate.runner.Runner) in windows of `seq_len`.

    `progress`: a bar on stderr (True), none (False), or (None) a bar when stderr is a terminal
    and otherwise a notice line when it starts and about every NOTICE_EVERY_S seconds.
    """
    parts = windows(ids, seq_len)
    if not parts:
        raise InputError(f"{len(ids)} token(s) give nothing to predict: expected at least 2 tokens")
    total = sum(len(w) - 1 for w in parts)
    sums, argmax = _score(runner, [(w, np.ones(len(w) - 1, bool)) for w in parts], seq_len, progress)
    return Score([t for w in parts for t in w], len(parts), total, sum(sums) / total, argmax)


def score_records(runner: Any, records: Sequence[tuple[int, Sequence[int], Sequence[bool]]], seq_len: int,
                  progress: bool | None = None) -> Score:
    """Score each record (line, ids, counted) on its own, in windows of `seq_len` as `perplexity`
    does; only targets j with counted[j] add. `nll` is the mean over every counted prediction of
    all records; `predictions` counts those, while `tokens` and `argmax` cover every window."""
    parts, owner = [], []
    for k, (_, ids, counted) in enumerate(records):
        counted = np.asarray(counted, dtype=bool)
        for j, w in enumerate(windows(np.asarray(ids, dtype=np.int64).tolist(), seq_len)):
            parts.append((w, counted[j * seq_len + 1:j * seq_len + len(w)]))  # a window's first predicts nothing
            owner.append(k)
    total = sum(int(mask.sum()) for _, mask in parts)
    if total == 0:
        raise InputError(f"{len(records)} record(s) have no counted token to score: expected answers, "
                         "completions or text (or --train-on-prompt)")
    sums, argmax = _score(runner, parts, seq_len, progress)
    nll, count, tokens = np.zeros(len(records)), np.zeros(len(records), np.int64), np.zeros(len(records), np.int64)
    for k, (w, mask), s in zip(owner, parts, sums):
        nll[k], count[k], tokens[k] = nll[k] + s, count[k] + mask.sum(), tokens[k] + len(w)
    per = [RecordScore(line, int(t), int(n), float(s / n) if n else None)
           for (line, _, _), t, n, s in zip(records, tokens, count, nll)]
    return Score([t for w, _ in parts for t in w], len(parts), total, sum(sums) / total, argmax, per)


def _score(runner: Any, parts: list[tuple[list[int], np.ndarray]], seq_len: int,
           progress: bool | None) -> tuple[list[float], list[int]]:
    """Each window's summed nll over the targets its mask counts, and every window's argmax
    choices at every position but its last, concatenated."""
    from tqdm import tqdm

    total = sum(int(mask.sum()) for _, mask in parts)
    bar_on = progress if progress is not None else sys.stderr.isatty()
    lines = progress is None and not bar_on
    if lines:
        _notice(f"perplexity: {total:,} predictions in {len(parts)} window(s) of up to {seq_len} tokens")
    nll, done, sums, argmax, last = 0.0, 0, [], [], time.monotonic()
    with tqdm(total=total, unit="tok", desc="perplexity", file=sys.stderr, dynamic_ncols=True,
              disable=not bar_on) as bar:
        for k, (w, mask) in enumerate(parts, 1):
            logits = runner.prefill(w, runner.new_cache())[:-1]  # [T-1, V]: the last predicts nothing here
            sums.append(float(token_nll(logits, np.asarray(w[1:]))[mask].sum()))
            nll, done = nll + sums[-1], done + int(mask.sum())
            argmax += logits.argmax(axis=1).tolist()
            bar.update(int(mask.sum()))
            so_far = f"{math.exp(nll / done):.3f}" if done else "-"
            bar.set_postfix_str(f"ppl={so_far}", refresh=False)
            if lines and k < len(parts) and time.monotonic() - last >= NOTICE_EVERY_S:
                last = time.monotonic()
                _notice(f"perplexity: window {k}/{len(parts)}, {done:,}/{total:,} predictions, "
                        f"ppl {so_far} so far")
    return sums, argmax


def _notice(msg: str) -> None:
    print(f"anelm: {msg}", file=sys.stderr, flush=True)
