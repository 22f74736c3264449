"""Learning-rate schedule: linear warmup, then cosine decay to a floor (docs/training.md).

Both phases scale with the total number of optimizer steps, so `--steps 100` and
`--steps 10000` trace the same curve. Steps are 0-based optimizer steps: `lr(0)` is the rate
of the first update. Warmup starts at peak/W rather than 0 so the first step is not wasted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class CosineSchedule:
    peak_lr: float
    total_steps: int
    warmup_steps: int | None = None  # None: 5 % of total_steps, rounded
    min_lr_ratio: float = 0.1        # floor = 10 % of peak, as the reference trainer uses

    def __post_init__(self):
        if self.total_steps < 1:
            raise UsageError(f"schedule: expected total steps >= 1, got {self.total_steps}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.total_steps:
            raise UsageError(f"schedule: expected warmup in [0, {self.total_steps}], "
                             f"got {self.warmup_steps}")

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(round(0.05 * self.total_steps))

    def __call__(self, step: int) -> float:
        w, floor = self.warmup, self.peak_lr * self.min_lr_ratio
        if step < w:
            return self.peak_lr * (step + 1) / w
        decay_steps = self.total_steps - w
        if decay_steps <= 1:
            return self.peak_lr
        # the last step (total − 1) lands exactly on the floor
        progress = min((step - w) / (decay_steps - 1), 1.0)
        return floor + 0.5 * (self.peak_lr - floor) * (1.0 + math.cos(math.pi * progress))
