"""Data-parallel training: all-reduce time and bytes per step against the step time, 1 and 2 ranks.

Runs `anelm train --distributed` as real processes on this machine (loopback, gloo), once as a
job of one rank and once of two, and reads their metrics.jsonl: per step `t_step`,
`allreduce_ms` (first bucket launched to last bucket summed), `allreduce_wait_ms` (what the
step waited for after its own backward: the communication not hidden) and `allreduce_bytes`
(the float32 gradient payload). Medians over the steps after the first two (gloo connects and
numba warms up on those).

Then the link a real multi-Mac job needs: a ring all-reduce sends and receives 2(W-1)/W times
the gradient bytes per rank; hidden behind the step means moving them within the step time.

    python benchmarks/bench_distributed.py                       # stories15m shape, seq 64
    python benchmarks/bench_distributed.py --preset tiny --steps 10

On a 2-core machine the two ranks share the cores, so the 2-rank step is slower here for
reasons a job on two machines does not have; the bytes and the all-reduce times are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from anelm.train.presets import count_params, get_preset

MADERIX_STORIES110M_STEP_S = 0.091  # maderix README, dynamic pipeline on M4 (reference facts §)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world: int, out: Path, args) -> list[dict]:
    flags = [f"--preset={args.preset}", f"--steps={args.steps}", f"--batch-size={args.batch_size}",
             f"--seq-len={args.seq_len}", f"--bpe-vocab-size={args.vocab}", f"--eval-every={args.steps}",
             "--eval-batches=1", f"--save-every={args.steps}", "--sample-tokens=0", "--device=emulator",
             f"--out={out}", "--distributed"]
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, "-m", "anelm", "train", *flags], env={**env, "RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            sys.exit(f"a rank failed:\n{err[-2000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r][2:]


def median(recs: list[dict], key: str) -> float:
    return statistics.median(float(r[key]) for r in recs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="stories15m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary trained on the built-in corpus")
    args = p.parse_args()
    print(f"{args.preset}, batch {args.batch_size} x seq {args.seq_len} per rank, emulator, loopback gloo")
    print(f"{'ranks':>5} {'step ms':>9} {'all-reduce ms':>14} {'not hidden ms':>14} {'bytes/step':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            recs = run_job(world, Path(tmp) / f"w{world}", args)
            step, ar = 1e3 * median(recs, "t_step"), median(recs, "allreduce_ms")
            wait, nbytes = median(recs, "allreduce_wait_ms"), int(median(recs, "allreduce_bytes"))
            # all-reduce ms spans the backward (buckets leave as layers finish): not a link rate
            print(f"{world:>5} {step:>9.1f} {ar:>14.1f} {wait:>14.1f} {nbytes:>12,}")
    link_needed()


LINKS = {"10 GbE": 1.25e9, "Thunderbolt 4 (40 Gbit/s)": 5e9, "Thunderbolt 5 (80 Gbit/s)": 10e9}  # line rates


def link_needed(step_s: float = MADERIX_STORIES110M_STEP_S) -> None:
    """The bandwidth a ring all-reduce of Stories110M's float32 gradients needs to hide behind
    the backward of a step, and what W Macs gain over one at some link rates.

    Model: the buckets travel during the last micro-batch's backward, B = 2/3 of a step T (dx
    and dW are twice the forward's work); an optimizer step of k micro-batches on W Macs takes
    k·T + max(0, C - B) with C = 2(W-1)/W · gradient bytes / rate; one Mac needs W·k·T for the
    same global batch."""
    n = count_params(get_preset("stories110m"))
    grad, backward = 4 * n, step_s * 2 / 3
    print(f"\nStories110M: {n / 1e6:.1f} M parameters, {grad / 1e6:.0f} MB of float32 gradients per "
          f"step; step {1e3 * step_s:.0f} ms (maderix, M4), backward ~{1e3 * backward:.0f} ms of it")
    for world in (2, 4):
        traffic = 2 * (world - 1) / world * grad
        print(f"  {world} Macs: {traffic / 1e6:.0f} MB each way per rank; hidden behind the backward "
              f"at {traffic / backward / 1e9:.1f} GB/s ({8 * traffic / backward / 1e9:.0f} Gbit/s) or more")
    print("  speed-up of 2 Macs over one (same global batch), by link line rate and --grad-accum:")
    traffic = grad
    for name, rate in LINKS.items():
        gains = []
        for k in (1, 4, 16):
            t = k * step_s + max(0.0, traffic / rate - backward)
            gains.append(f"k={k}: {2 * k * step_s / t:.2f}x")
        print(f"    {name:<26} all-reduce {1e3 * traffic / rate:4.0f} ms; " + ", ".join(gains))


if __name__ == "__main__":
    main()
