"""Timing shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def finetune_flags(p, *, steps: int, batch_size: int, seq_len: int, rank: int, targets: str,
                   variants: tuple[str, ...]) -> None:
    """The flags the fine-tuning benchmarks share (each script adds its own and its defaults)."""
    p.add_argument("--steps", type=int, default=steps, help="timed steps per process (after the first step)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--rank", type=int, default=rank)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default=targets)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's threads (default 1: on a loaded 2-core machine 2 OpenMP threads spin "
                        "and a step took 10-30x longer)")
    p.add_argument("--worker", choices=variants, help=argparse.SUPPRESS)


def rounds(script: str, variants: tuple[str, ...], a, forward: tuple[str, ...],
           env: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """`a.rounds` rounds of every variant, each in a process of its own (`script --worker=KIND`
    with the flags in `forward` as `a` holds them), whose last line of output is its figures as
    JSON; a variant that fails ends the benchmark with its error."""
    got: dict[str, list[dict]] = {k: [] for k in variants}
    flags = [f"--{name.replace('_', '-')}={getattr(a, name)}" for name in forward]
    for r in range(a.rounds):
        for kind in variants:
            p = subprocess.run([sys.executable, script, f"--worker={kind}", *flags], capture_output=True, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
            if p.returncode:
                sys.exit(f"{kind} failed:\n{p.stderr[-3000:]}")
            got[kind].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {kind} done", file=sys.stderr, flush=True)
    return got
