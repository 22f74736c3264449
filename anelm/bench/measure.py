"""Measurements beside the predictions: the emulator (or the ANE) runs the same programs.

On the emulator these are this host's figures, kept to catch regressions of the emulator, never
to stand for a chip. Timings are best-of `repeat` after one warm-up run, by the wall clock and by
this process's CPU time (`Timing`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from ..runtime.kernel import Kernel


class Timing(NamedTuple):
    """Seconds of the fastest run by the wall clock, and the least CPU time the calling thread
    spent on a run: the emulator's own work (it runs in this thread; the process's CPU time
    would add a BLAS worker's spinning, which contention moves). Other processes on a busy
    machine stretch the first far more than the second: beside a CPU-bound and a BLAS process
    on 2 cores, the best of 5 train steps of `tiny` took 2.2-3x its quiet wall time and at most
    1.06x its CPU time, a decode step 3.9-4.5x and 1.35x. `bench --baseline` judges the
    emulator on the CPU figures."""

    wall: float
    cpu: float

    def scaled(self, k: float) -> "Timing":
        return Timing(self.wall * k, self.cpu * k)


def timed(fn) -> Timing:
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return Timing(time.perf_counter() - t0, time.thread_time() - c0)


def least(a: Timing, b: Timing) -> Timing:
    return Timing(min(a.wall, b.wall), min(a.cpu, b.cpu))


def best_of(fn, repeat: int) -> Timing:
    """The fastest of `repeat` calls (by each clock), after one warm-up call."""
    fn()
    best = timed(fn)
    for _ in range(max(1, repeat) - 1):
        best = least(best, timed(fn))
    return best


def time_program(artifact, device, repeat: int = 3) -> Timing:
    """Seconds of one evaluation of `artifact` on `device`, random fp16-range inputs."""
    rng = np.random.default_rng(0)
    with Kernel(artifact, device) as k:
        arrays = {s.name: rng.uniform(-1, 1, s.shape).astype(np.float32) for s in artifact.signature.inputs}
        return best_of(lambda: k.run(arrays), repeat)


def time_train_step(config: dict, device, seq_len: int, batch: int, pipeline: str, repeat: int = 2) -> Timing:
    """Seconds of one forward + backward (loss_and_grads) of `config` on `device`, random weights."""
    from ..train.init import init_weights, model_config
    from ..train.steps.llama import DeviceTrainStep

    cfg = model_config(config)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config["vocab_size"], (batch, seq_len))
    y = rng.integers(0, config["vocab_size"], (batch, seq_len))
    with DeviceTrainStep(cfg, init_weights(cfg, 0), device, seq_len=seq_len, pipeline=pipeline) as step:
        return best_of(lambda: step.loss_and_grads(x, y, 1.0), repeat)


def time_generate(config, device, prompt_tokens: int = 32, new_tokens: int = 8,
                  weights=None, repeat: int = 3) -> tuple[Timing, Timing]:
    """(prefill, decode per token) of our device pipeline, each the best of `repeat` runs: the
    model's own weights when given (bench generate --model), else random ones."""
    from ..generate.pipeline import build_runner
    from ..train.init import init_weights

    weights = init_weights(config, 0) if weights is None else weights
    runner = build_runner(config, weights, device, max_context=max(256, prompt_tokens + new_tokens + 1))
    ids = list(np.random.default_rng(0).integers(0, config.vocab_size, prompt_tokens))
    try:
        warm = runner.new_cache()  # compile the bucket's and the tier's programs first
        runner.prefill(ids, warm, last_only=True)
        runner.decode(int(ids[0]), warm)
        prefill = decode = Timing(float("inf"), float("inf"))
        for _ in range(max(1, repeat)):
            cache = runner.new_cache()
            prefill = least(prefill, timed(lambda: runner.prefill(ids, cache, last_only=True)))
            decode = least(decode, timed(lambda: [runner.decode(int(ids[i % len(ids)]), cache)
                                                  for i in range(new_tokens)]))
        return prefill, decode.scaled(1 / new_tokens)
    finally:
        runner.close()
