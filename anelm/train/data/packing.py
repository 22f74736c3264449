"""Sequences and batches from instruction examples (docs/fine-tuning.md).

    examples, cut = fit(examples, seq_len)           # a notice says how many were cut
    batcher = ExampleBatcher(examples, batch_size, seq_len, seed, shard=(rank, world))
    batch = batcher.draw()                             # x, y, positions, counted

An example of L tokens gives L-1 predictions, so it takes L-1 slots of a sequence of seq_len
inputs: x = ids[:-1], y = ids[1:] where counted (IGNORE elsewhere). Packed sequences hold several
examples one after another; each example's positions restart at 0, and so do the padding's at
the end of a sequence (a segment of its own). A segment starts wherever the position is 0, so
attention kept inside each example is: query i sees key j iff j <= i and no position between
j+1 and i is 0. Padding inputs are id 0 (any valid id; nothing reads what it predicts).

The loss is the mean over counted targets of the global batch (all ranks' rows): `Batch.counted`
is that denominator, so a rank divides its rows' summed loss by it and the ranks' losses add up.
"""

from __future__ import annotations

import numpy as np

from . import Batch, unigram_entropy
from ..errors import DataError
from ..steps.cpu_ops import IGNORE
from .instruct import Example

PAD_ID = 0  # the input id of padding slots: valid in every vocabulary, its targets are IGNORE


# ---------------------------------------------------------------------------- the set

def fit(examples: list[Example], seq_len: int) -> tuple[list[Example], int]:
    """The examples with those longer than seq_len + 1 tokens cut to seq_len + 1 (seq_len
    predictions); returns (examples, how many were cut)."""
    out, cut = [], 0
    for e in examples:
        if len(e.ids) > seq_len + 1:
            e, cut = Example(e.ids[:seq_len + 1], e.counted[:seq_len + 1], e.line), cut + 1
        out.append(e)
    return out, cut


def counted_total(examples: list[Example]) -> int:
    """Counted targets over the examples (pass `fit`'s output for what training sees)."""
    return sum(int(e.counted.sum()) for e in examples)


def counted_entropy(examples: list[Example]) -> float:
    """The unigram entropy in nats of the counted target tokens: the loss plot's reference line,
    the loss of a model that knows only how often each answer token occurs."""
    targets = [e.ids[e.counted] for e in examples]
    flat = np.concatenate(targets) if targets else np.zeros(0, np.int64)
    return unigram_entropy(flat) if flat.size else 0.0


def sequences(examples: list[Example], seq_len: int, pack: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(x [M, S], y [M, S], positions [M, S] or None) of the examples in the given order.

    pack: first fit, each example into the first sequence with room for its L-1 predictions,
    else a new one. Without pack, one example per sequence and positions None: the padding
    after an example continues its positions, so a plain causal mask keeps it out of the
    example's queries. Examples of fewer than 2 tokens predict nothing and take no sequence.
    """
    examples = [e for e in fit(examples, seq_len)[0] if len(e.ids) >= 2]
    if pack:
        rows, offsets = _first_fit([len(e.ids) - 1 for e in examples], seq_len)
    else:
        rows, offsets = np.arange(len(examples)), np.zeros(len(examples), np.int64)
    m = int(rows.max()) + 1 if len(rows) else 0
    x = np.full((m, seq_len), PAD_ID, np.int64)
    y = np.full((m, seq_len), IGNORE, np.int64)
    positions = np.zeros((m, seq_len), np.int64) if pack else None
    fill = np.zeros(m, np.int64)
    for e, r, o in zip(examples, rows, offsets):
        n = len(e.ids) - 1
        x[r, o:o + n] = e.ids[:-1]
        y[r, o:o + n] = np.where(e.counted[1:], e.ids[1:], IGNORE)
        if positions is not None:
            positions[r, o:o + n] = np.arange(n)
        fill[r] = max(fill[r], o + n)
    if positions is not None:
        for r in np.flatnonzero(fill < seq_len):  # the padding: a segment of its own
            positions[r, fill[r]:] = np.arange(seq_len - fill[r])
    return x, y, positions


def _first_fit(sizes: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, offset) of each item placed first-fit into rows of seq_len slots."""
    free = np.zeros(len(sizes), np.int64)  # room left in each opened row (at most one per item)
    opened, rows, offsets = 0, np.zeros(len(sizes), np.int64), np.zeros(len(sizes), np.int64)
    for i, n in enumerate(sizes):
        fits = np.flatnonzero(free[:opened] >= n)
        r = int(fits[0]) if len(fits) else opened
        if r == opened:
            free[r], opened = seq_len, opened + 1
        rows[i], offsets[i] = r, seq_len - free[r]
        free[r] -= n
    return rows, offsets


# ---------------------------------------------------------------------------- batches

class ExampleBatcher:
    """Batches of sequences in epochs: each epoch permutes the examples with a generator seeded
    from (seed, epoch), so the order is reproducible without carrying generator state, packs them,
    and batches take the next world × batch_size sequences, running on into the next epoch.
    The state is (epoch, cursor, drawn): a resumed run draws exactly what the straight run would.

    `shard=(rank, world)`: every rank builds the same global batch and keeps rows rank·B ..
    rank·B + B, as `data.Batcher` does, so the ranks together see what one process with batch
    world × B sees."""

    def __init__(self, examples: list[Example], batch_size: int, seq_len: int, seed: int,
                 shard: tuple[int, int] = (0, 1), pack: bool = True):
        self.examples = [e for e in fit(examples, seq_len)[0] if len(e.ids) >= 2]
        if not self.examples:
            raise DataError(f"the instruction data has no record of 2 or more tokens; expected at least "
                            f"one with something to predict ({len(examples)} record(s))")
        if counted_total(self.examples) == 0:
            raise DataError(f"the instruction data has no counted token in its {len(examples)} record(s); "
                            "expected answers, completions or text to learn (or --train-on-prompt)")
        self.batch_size, self.seq_len, self.seed, self.shard, self.pack = batch_size, seq_len, seed, shard, pack
        self.epoch, self.cursor, self.drawn = 0, 0, 0
        self._built: tuple[int, tuple] | None = None  # (epoch, its sequences)

    def epoch_sequences(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The sequences of one epoch, in order: (x, y, positions) as `sequences` gives them."""
        if self._built is None or self._built[0] != epoch:
            order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(len(self.examples))
            self._built = epoch, sequences([self.examples[i] for i in order], self.seq_len, self.pack)
        return self._built[1]

    def draw(self) -> Batch:
        """This rank's rows of the next global batch of world × batch_size sequences."""
        rank, world = self.shard
        need, parts = self.batch_size * world, []
        while need:  # a global batch may run on into the next epoch (or several, for a small set)
            seqs = self.epoch_sequences(self.epoch)
            take = min(need, len(seqs[0]) - self.cursor)
            parts.append((seqs, slice(self.cursor, self.cursor + take)))
            need, self.cursor = need - take, self.cursor + take
            if self.cursor == len(seqs[0]):
                self.epoch, self.cursor = self.epoch + 1, 0
        self.drawn += 1
        x, y = (np.concatenate([seqs[k][rows] for seqs, rows in parts]) for k in (0, 1))
        mine = slice(rank * self.batch_size, (rank + 1) * self.batch_size)
        pos = np.concatenate([seqs[2][rows] for seqs, rows in parts])[mine] if self.pack else None
        return Batch(x[mine], y[mine], pos, int((y != IGNORE).sum()))

    def state_dict(self) -> dict:
        """JSON-able: the data position."""
        return {"epoch": self.epoch, "cursor": self.cursor, "drawn": self.drawn}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.cursor, self.drawn = int(d["epoch"]), int(d["cursor"]), int(d["drawn"])


def eval_batches(examples: list[Example], batch_size: int, seq_len: int, shard: tuple[int, int] = (0, 1),
                 pack: bool = True) -> list[Batch]:
    """The whole set in file order (no shuffle), in global batches of world × batch_size
    sequences; this rank keeps rows rank·B .. rank·B + B of each, as in training. The last global
    batch is filled up with padding rows (every target IGNORE), so every batch on every rank has
    batch_size rows (one compiled shape) and every rank runs the same number of batches. Each
    `Batch.counted` counts its global batch's targets, so a rank's loss on a batch (its rows' sum
    over that count) times the count is its rows' summed nll: the caller adds those up, all-reduces
    the sum and divides by `counted_total`. Every counted target is in exactly one batch's rows."""
    rank, world = shard
    x, y, pos = sequences(examples, seq_len, pack)
    if not (y != IGNORE).any():
        raise DataError(f"the validation data has no counted target in its {len(examples)} record(s); "
                        "expected answers, completions or text to score")
    group = batch_size * world
    short = -len(x) % group
    if short:  # padding rows, positions 0..S-1: one segment of nothing
        x = np.concatenate([x, np.full((short, seq_len), PAD_ID, np.int64)])
        y = np.concatenate([y, np.full((short, seq_len), IGNORE, np.int64)])
        pos = None if pos is None else np.concatenate([pos, np.tile(np.arange(seq_len), (short, 1))])
    out = []
    for start in range(0, len(x), group):
        mine = slice(start + rank * batch_size, start + (rank + 1) * batch_size)
        out.append(Batch(x[mine], y[mine], None if pos is None else pos[mine],
                         int((y[start:start + group] != IGNORE).sum())))
    return out
