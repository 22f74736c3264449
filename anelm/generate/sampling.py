"""Samplers and logit processors, as plain callables, and the options one request sets.

A sampler maps log-probabilities [V] to a token id. A logit processor maps (tokens so far,
logits [V]) to new logits. The order is HF's: the processors (repetition penalty, OpenAI's
presence and frequency penalties, logit bias, then any of the caller's), then temperature,
top-k, top-p, min-p.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import UsageError

Sampler = Callable[[np.ndarray], int]
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


class SamplingError(UsageError):
    """A sampling value out of range (a usage error: the caller chose it)."""


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# field: (valid, what is expected), in the order they are checked; the ranges are OpenAI's
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _real(v) and v >= 0, ">= 0 (0 is greedy)"),
    "top_k": (lambda v: _int(v) and v >= 0, "an integer >= 0 (0 is off)"),
    "top_p": (lambda v: _real(v) and 0 < v <= 1, "in (0, 1] (1 is off)"),
    "repetition_penalty": (lambda v: _real(v) and v > 0, "> 0 (1 is off)"),
    "max_tokens": (lambda v: v is None or _int(v) and v >= 0, "an integer >= 0"),
    "min_p": (lambda v: _real(v) and 0 <= v <= 1, "in [0, 1] (0 is off)"),
    "presence_penalty": (lambda v: _real(v) and -2 <= v <= 2, "in [-2, 2] (0 is off)"),
    "frequency_penalty": (lambda v: _real(v) and -2 <= v <= 2, "in [-2, 2] (0 is off)"),
    "seed": (lambda v: v is None or _int(v), "an integer"),
    "stop": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v), "a list of strings"),
    "logit_bias": (lambda v: isinstance(v, Mapping), "a map of token ids to biases"),
    "logprobs": (lambda v: isinstance(v, bool), "true or false"),
    "top_logprobs": (lambda v: _int(v) and 0 <= v <= 20, "an integer in [0, 20]"),
}


def _check(values: dict[str, Any], spell: Callable[[str], str] = str) -> None:
    for name, value in values.items():
        valid, expected = RULES[name]
        if not valid(value):
            raise SamplingError(f"{spell(name)} must be {expected}, got {value}")


def check_sampling(temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                   repetition_penalty: float = 1.0, max_tokens: int = 0, min_p: float = 0.0) -> None:
    """The flags' checks: errors spell the names as the flags do (`top-k`)."""
    _check(dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                max_tokens=max_tokens, min_p=min_p), spell=lambda name: name.replace("_", "-"))


@dataclass(frozen=True)
class SamplingOptions:
    """What one request asks of generation, under OpenAI's names (and its defaults)."""

    max_tokens: int | None = None  # None: until EOS, a stop string or the end of the context
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 is off
    min_p: float = 0.0  # 0 is off
    seed: int | None = None  # the same seed draws the same tokens in every request
    stop: Sequence[str] = ()
    presence_penalty: float = 0.0  # per token that the generated text holds
    frequency_penalty: float = 0.0  # per time the generated text holds the token
    repetition_penalty: float = 1.0  # HF's (CTRL's), over prompt and generated text; 1 is off
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int = 0  # and the likeliest tokens' at each step, with `logprobs`

    def check(self, vocab_size: int | None = None) -> SamplingOptions:
        """The options themselves, or a SamplingError naming the first field out of range."""
        _check({name: getattr(self, name) for name in RULES})
        for token, bias in self.logit_bias.items():
            if not (_int(token) and 0 <= token < (vocab_size or math.inf)):
                where = f"in [0, {vocab_size})" if vocab_size else ">= 0"
                raise SamplingError(f"logit_bias token ids must be integers {where}, got {token}")
            if not (_real(bias) and -100 <= bias <= 100):
                raise SamplingError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        return self

    def sampler(self) -> Sampler:
        """A fresh sampler, its generator seeded anew: each request with a seed draws alike."""
        return make_sampler(self.temperature, self.top_k, self.top_p, self.seed, self.min_p)

    def processors(self, prompt_length: int) -> list[LogitsProcessor]:
        """The logit processors, in HF's order; the penalties count generated tokens from
        `prompt_length` on."""
        out = make_logits_processors(self.repetition_penalty)
        if self.presence_penalty or self.frequency_penalty:
            out.append(penalty_processor(self.presence_penalty, self.frequency_penalty, prompt_length))
        if self.logit_bias:
            out.append(logit_bias_processor(self.logit_bias))
        return out


def greedy(logprobs: np.ndarray) -> int:
    return int(np.argmax(logprobs))  # the first maximum on ties


def sampling_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> np.ndarray:
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
    if min_p > 0:
        p = np.where(p < min_p * p.max(), 0.0, p)  # the likeliest token always stays
        p /= p.sum()
    return p


def make_sampler(temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, min_p: float = 0.0) -> Sampler:
    """Greedy when temperature is 0; otherwise draws from `sampling_probs` with a seeded Generator."""
    check_sampling(temperature, top_k, top_p, min_p=min_p)
    if temperature == 0:
        return greedy
    # numpy takes seeds >= 0; OpenAI's are any 64-bit integer
    rng = np.random.default_rng(seed if seed is None or seed >= 0 else seed % 2**64)

    def sample(logprobs: np.ndarray) -> int:
        cdf = np.cumsum(sampling_probs(logprobs, temperature, top_k, top_p, min_p))
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


def penalty_processor(presence: float, frequency: float, prompt_length: int) -> LogitsProcessor:
    """OpenAI's presence and frequency penalties: logit -= presence·[count > 0] + frequency·count,
    where count is how often the generated text (not the prompt) holds the token."""

    def apply(tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        ids, counts = np.unique(np.asarray(tokens[prompt_length:], np.int64), return_counts=True)
        if not ids.size:
            return logits
        out = logits.copy()
        out[ids] -= (presence + frequency * counts).astype(out.dtype)
        return out

    return apply


def logit_bias_processor(bias: Mapping[int, float]) -> LogitsProcessor:
    """OpenAI's logit_bias: each listed token's logit moves by its bias (-100 all but bans it)."""
    ids = np.fromiter(bias.keys(), np.int64, len(bias))
    values = np.fromiter(bias.values(), np.float64, len(bias))

    def apply(tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        out[ids] += values.astype(out.dtype)
        return out

    return apply
