"""Teacher-forced scoring of a text (CONTRACTS §7): what tells whether a model, a quantization
or a fine-tune is right.

    score = perplexity(runner, ids, seq_len=512)
    score.ppl, score.nll, score.argmax

The ids are cut into consecutive windows of `seq_len`; each window is scored on its own from an
empty cache (one prefill, logits at every position), so a window never sees the text before it,
as in HF's and llama.cpp's fixed-window perplexity. A last window shorter than 2 tokens has
nothing to predict and is dropped.
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


@dataclass(frozen=True)
class Score:
    tokens: list[int]  # the evaluated ids (the windows, concatenated)
    windows: int
    predictions: int  # next-token predictions scored: every position of a window but its last
    nll: float  # mean negative log-likelihood, nats
    argmax: list[int]  # each window's argmax next-token id at every position but its last

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def windows(ids: Sequence[int], seq_len: int) -> list[list[int]]:
    """Consecutive windows of `seq_len` ids; a last one shorter than 2 is dropped."""
    if seq_len < 2:
        raise InputError(f"--seq-len {seq_len} is too short: expected at least 2 tokens per window")
    cut = [list(ids[i:i + seq_len]) for i in range(0, len(ids), seq_len)]
    return [w for w in cut if len(w) >= 2]


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64 (a 49k-way log-sum-exp in float32 loses
    the digits that a perplexity ratio of 1.001 is judged on)."""
    z = logits.astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=1)) + m[:, 0]
    return lse - z[np.arange(len(z)), targets]


def perplexity(runner: Any, ids: Sequence[int], seq_len: int, progress: bool | None = None) -> Score:
    """Score `ids` with `runner` (anelm.generate.runner.Runner) in windows of `seq_len`.

    `progress`: a bar on stderr (True), none (False), or (None) a bar when stderr is a terminal
    and otherwise a notice line when it starts and about every NOTICE_EVERY_S seconds.
    """
    from tqdm import tqdm

    parts = windows(ids, seq_len)
    if not parts:
        raise InputError(f"{len(ids)} token(s) give nothing to predict: expected at least 2 tokens")
    total = sum(len(w) - 1 for w in parts)
    bar_on = progress if progress is not None else sys.stderr.isatty()
    lines = progress is None and not bar_on
    if lines:
        _notice(f"perplexity: {total:,} predictions in {len(parts)} window(s) of up to {seq_len} tokens")
    nll, argmax, last = 0.0, [], time.monotonic()
    with tqdm(total=total, unit="tok", desc="perplexity", file=sys.stderr, dynamic_ncols=True,
              disable=not bar_on) as bar:
        for k, w in enumerate(parts, 1):
            logits = runner.prefill(w, runner.new_cache())[:-1]  # [T-1, V]: the last predicts nothing here
            nll += float(token_nll(logits, np.asarray(w[1:])).sum())
            argmax += [int(i) for i in logits.argmax(axis=1)]
            bar.update(len(w) - 1)
            bar.set_postfix_str(f"ppl={math.exp(nll / len(argmax)):.3f}", refresh=False)
            if lines and k < len(parts) and time.monotonic() - last >= NOTICE_EVERY_S:
                last = time.monotonic()
                _notice(f"perplexity: window {k}/{len(parts)}, {len(argmax):,}/{total:,} predictions, "
                        f"ppl {math.exp(nll / len(argmax)):.3f} so far")
    return Score([t for w in parts for t in w], len(parts), total, nll / total, argmax)


def _notice(msg: str) -> None:
    print(f"anelm: {msg}", file=sys.stderr, flush=True)
