"""Samplers and logit processors, as plain callables.

A sampler maps log-probabilities [V] to a token id. A logit processor maps (tokens so far,
logits [V]) to new logits. Order of the sampling steps, as in HF: temperature, top-k, top-p.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..errors import UsageError

Sampler = Callable[[np.ndarray], int]
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


class SamplingError(UsageError):
    """A sampling value out of range (a usage error: the caller chose it)."""


def check_sampling(temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                   repetition_penalty: float = 1.0, max_tokens: int = 0) -> None:
    checks = [
        ("temperature", temperature, math.isfinite(temperature) and temperature >= 0, ">= 0 (0 is greedy)"),
        ("top-k", top_k, isinstance(top_k, int) and top_k >= 0, "an integer >= 0 (0 is off)"),
        ("top-p", top_p, 0 < top_p <= 1, "in (0, 1] (1 is off)"),
        ("repetition-penalty", repetition_penalty,
         math.isfinite(repetition_penalty) and repetition_penalty > 0, "> 0 (1 is off)"),
        ("max-tokens", max_tokens, isinstance(max_tokens, int) and max_tokens >= 0, "an integer >= 0"),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise SamplingError(f"{name} must be {expected}, got {value}")


def greedy(logprobs: np.ndarray) -> int:
    return int(np.argmax(logprobs))  # the first maximum on ties


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution a non-greedy sampler draws from, float64 [V]."""
    z = np.asarray(logits, np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)  # ties with the k-th value stay, as in HF
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        n = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1  # smallest prefix with mass >= top_p
        keep = np.zeros_like(p)
        keep[order[:n]] = p[order[:n]]
        p = keep / keep.sum()
    return p


def make_sampler(temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None) -> Sampler:
    """Greedy when temperature is 0; otherwise draws from `sampling_probs` with a seeded Generator."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return greedy
    rng = np.random.default_rng(seed)

    def sample(logprobs: np.ndarray) -> int:
        cdf = np.cumsum(sampling_probs(logprobs, temperature, top_k, top_p))
        return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), cdf.size - 1))

    return sample


def repetition_penalty_processor(penalty: float) -> LogitsProcessor:
    """CTRL's rule, as HF: a seen token's logit is divided by `penalty` if positive, else multiplied."""
    check_sampling(repetition_penalty=penalty)

    def apply(tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if not len(tokens):
            return logits
        seen = np.unique(np.asarray(tokens, np.int64))
        out = logits.copy()
        out[seen] = np.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
        return out

    return apply


def make_logits_processors(repetition_penalty: float = 1.0) -> list[LogitsProcessor]:
    return [] if repetition_penalty == 1.0 else [repetition_penalty_processor(repetition_penalty)]
