"""Timing shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import time
from typing import Callable


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of `repeat` timed calls of fn, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
