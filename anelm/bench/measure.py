"""Measurements beside the predictions: the emulator (or the ANE) runs the same programs.

On the emulator these are this host's figures, kept to catch regressions of the emulator, never
to stand for a chip. Timings are best-of `repeat` after one warm-up run.
"""

from __future__ import annotations

import time

import numpy as np

from ..runtime.kernel import Kernel


def best_of(fn, repeat: int) -> float:
    """Seconds of the fastest of `repeat` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_program(artifact, device, repeat: int = 3) -> float:
    """Seconds of one evaluation of `artifact` on `device`, random fp16-range inputs."""
    rng = np.random.default_rng(0)
    with Kernel(artifact, device) as k:
        arrays = {s.name: rng.uniform(-1, 1, s.shape).astype(np.float32) for s in artifact.signature.inputs}
        return best_of(lambda: k.run(arrays), repeat)


def time_train_step(config: dict, device, seq_len: int, batch: int, pipeline: str, repeat: int = 2) -> float:
    """Seconds of one forward + backward (loss_and_grads) of `config` on `device`, random weights."""
    from ..train.init import init_weights, model_config
    from ..train.step import DeviceTrainStep

    cfg = model_config(config)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config["vocab_size"], (batch, seq_len))
    y = rng.integers(0, config["vocab_size"], (batch, seq_len))
    with DeviceTrainStep(cfg, init_weights(cfg, 0), device, seq_len=seq_len, pipeline=pipeline) as step:
        return best_of(lambda: step.loss_and_grads(x, y, 1.0), repeat)


def time_generate(config, device, prompt_tokens: int = 32, new_tokens: int = 8,
                  weights=None) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of our device pipeline: the model's own
    weights when given (bench generate --model), else random ones."""
    from ..generate.pipeline import build_runner
    from ..train.init import init_weights

    weights = init_weights(config, 0) if weights is None else weights
    runner = build_runner(config, weights, device, max_context=max(256, prompt_tokens + new_tokens + 1))
    ids = list(np.random.default_rng(0).integers(0, config.vocab_size, prompt_tokens))
    try:
        warm = runner.new_cache()  # compile the bucket's and the tier's programs first
        runner.prefill(ids, warm, last_only=True)
        runner.decode(int(ids[0]), warm)
        cache = runner.new_cache()
        t0 = time.perf_counter()
        runner.prefill(ids, cache, last_only=True)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(new_tokens):
            runner.decode(int(ids[i % len(ids)]), cache)
        return prefill, (time.perf_counter() - t0) / new_tokens
    finally:
        runner.close()
