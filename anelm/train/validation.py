"""The eval loss over a whole validation set, the best checkpoint, and early stopping
(docs/fine-tuning.md).

    v = Validation(batches, sync, patience=3, write_best=writer, run=RUN)
    loss = v.evaluate(step_device)        # token-weighted over every batch, every rank
    if v.record(step, loss): ...          # a new best: RUN/best/ and RUN/best.json written
    v.exhausted                           # `patience` evals in a row without a new best

The loss is the sum of the counted targets' cross-entropies over their number, across all the
batches of all the ranks (each batch's mean times its count, both all-reduced), so a valid set
of examples of different lengths is weighted by tokens, as HF's and mlx-lm's are, and two
ranks give the one-rank value.

`RUN/best/` holds what the run's trained tensors would be published as at the lowest eval loss
(`write_best(folder, step, params)`: the adapter in PEFT's layout for `finetune`, an HF folder
for `train`), replaced atomically; `RUN/best.json` (`{"step", "eval_loss"}`) is written after it,
so it never names a step the folder does not hold. The best and the count of evals since it
are in every checkpoint (`state_dict`), so a resumed run stops where the straight one would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..atomic import atomic_open
from .steps.cpu_ops import IGNORE

BEST_DIR, BEST_FILE = "best", "best.json"


class Validation:
    def __init__(self, batches: list, sync, *, patience: int | None = None, run: Path | None = None,
                 write_best: Callable[[Path, int, dict], None] | None = None):
        self.batches, self.sync, self.patience = batches, sync, patience
        self.run, self.write_best = run, write_best
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # evals after the best one

    def evaluate(self, dev) -> float:
        """The token-weighted mean cross-entropy of the counted targets over the whole set."""
        total, count = 0.0, 0
        for b in self.batches:
            n = int((b.y != IGNORE).sum())
            if n:
                total += dev.loss(b.x, b.y, positions=b.positions) * n
                count += n
        total, count = self.sync.mean(total), self.sync.mean(count)  # the ratio of the sums
        return total / count if count else float("nan")

    def record(self, step: int, loss: float, params: dict) -> bool:
        """Note an eval; on a new best, publish it (rank 0). Returns whether it is one."""
        if self.best_loss is not None and not loss < self.best_loss:
            self.since_best += 1
            return False
        self.best_loss, self.best_step, self.since_best = loss, step, 0
        if self.write_best is not None and self.sync.is_main:
            self.write_best(self.run / BEST_DIR, step, params)
            with atomic_open(self.run / BEST_FILE, "w", encoding="utf-8") as f:
                json.dump({"step": step, "eval_loss": loss}, f)
                f.write("\n")
        return True

    @property
    def exhausted(self) -> bool:
        return bool(self.patience) and self.since_best >= self.patience

    def state_dict(self) -> dict:
        return {"best_loss": self.best_loss, "best_step": self.best_step, "since_best": self.since_best}

    def load_state_dict(self, d: dict | None) -> None:
        d = d or {}
        self.best_loss, self.best_step = d.get("best_loss"), d.get("best_step")
        self.since_best = int(d.get("since_best", 0))


def weights_writer(setup) -> Callable[[Path, int, dict], None]:
    """`anelm train`'s best: the weights as an HF folder (`anelm export`'s), with the run's tokenizer."""
    from ..atomic import atomic_dir
    from .export import write_folder

    def write(folder: Path, step: int, params: dict) -> None:
        with atomic_dir(folder) as tmp:
            write_folder(tmp, setup.model_config, params, run=setup.run)

    return write
