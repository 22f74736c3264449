"""Generation: `generate_step` yields (token, logprobs); `generate` adds the stopping rules,
streamed text and timing.

Text is streamed in pieces that never split a UTF-8 character (a byte-level token may hold
half of one) and never show the start of a stop string that may still complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..models.errors import ContextError, InputError
from .runner import Cache, Runner
from .sampling import LogitsProcessor, Sampler, check_sampling, greedy


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float32) - np.max(logits)
    return z - np.log(np.sum(np.exp(z)))


def generate_step(runner: Runner, prompt_ids: Sequence[int], sampler: Sampler = greedy,
                  logits_processors: Sequence[LogitsProcessor] = (), cache: Cache | None = None
                  ) -> Iterator[tuple[int, np.ndarray]]:
    """Prefill the prompt, then yield (token, logprobs [V]) forever, or until the context is full.

    The next token is decoded only when the consumer asks for it, so stopping costs nothing.
    A `cache` that already holds the first `cache.length` prompt tokens (an earlier turn of a
    conversation) is continued: only the rest of the prompt is run.
    """
    cache = runner.new_cache() if cache is None else cache
    done = cache.length
    if done and done >= len(prompt_ids):
        raise InputError(f"the cache holds {done} positions; expected fewer than the prompt's "
                         f"{len(prompt_ids)} tokens, so that its last token runs")
    check_prompt(len(prompt_ids) - done, cache.capacity, done)
    logits = runner.prefill(list(prompt_ids[done:]), cache, last_only=True)[-1]
    tokens = list(prompt_ids)
    while True:
        for process in logits_processors:
            logits = process(tokens, logits)
        logprobs = log_softmax(logits)
        token = int(sampler(logprobs))
        yield token, logprobs
        tokens.append(token)
        if cache.length >= cache.capacity:
            return  # no position left to run this token at
        logits = runner.decode(token, cache)


def check_prompt(n: int, capacity: int, used: int = 0) -> None:
    """A prompt of n tokens fits after `used` positions of a context of `capacity`."""
    if n == 0:
        raise InputError("the prompt is empty: expected at least one token")
    if used + n > capacity:
        raise ContextError(f"the prompt is {used + n} tokens, longer than the model's context of "
                           f"{capacity} (max_position_embeddings)")


class TextStream:
    """The text of generated ids, growing as they come. `context` (the prompt's last token)
    is decoded in front and cut off again, so a leading space survives SentencePiece-style
    decoders that drop it at the start of a text."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()):
        self.tok, self.context = tokenizer, list(context)[-1:]
        self.prefix = tokenizer.decode(self.context) if self.context else ""

    def text(self, ids: Sequence[int], final: bool = False) -> str:
        full = self.tok.decode(self.context + list(ids))
        full = full[len(self.prefix):] if full.startswith(self.prefix) else self.tok.decode(list(ids))
        # U+FFFD at the end is a character whose remaining bytes are still to come.
        return full if final else full.rstrip("\ufffd")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int]  # generated ids, without the EOS that ended them
    text: str  # their text, cut before a stop string
    prefill_ms: float  # prompt in, first token out
    decode_tokens_per_s: float  # the tokens after the first
    finish_reason: str  # "eos", "stop", "length" (max_tokens), "context" (model context full) or "interrupted"


def generate(runner: Runner, tokenizer: Any, prompt_ids: Sequence[int], *, max_tokens: int = 128,
             sampler: Sampler = greedy, logits_processors: Sequence[LogitsProcessor] = (),
             stop: Sequence[str] = (), eos_ids: Sequence[int] | None = None,
             on_text: Callable[[str], None] | None = None, cache: Cache | None = None,
             interruptible: bool = False) -> GenerationResult:
    """Generate up to `max_tokens` tokens; stop at EOS (the model's and the tokenizer's) or at
    any of the `stop` strings. `on_text` receives the text as it is produced. `cache`: see
    `generate_step`; afterwards it holds the first `cache.length` of prompt + generated ids.
    `interruptible`: Ctrl-C (KeyboardInterrupt) ends the generation with what it has so far,
    reason "interrupted", instead of propagating (chat stops a reply, not the session). The
    cache stays usable: a runner advances `cache.length` only once a position is stored."""
    check_sampling(max_tokens=max_tokens)
    eos = set(runner.config.eos_ids if eos_ids is None else eos_ids)
    if eos_ids is None and getattr(tokenizer, "eos_id", None) is not None:
        eos.add(tokenizer.eos_id)
    out = _Collector(TextStream(tokenizer, prompt_ids), [s for s in stop if s], on_text)
    if max_tokens == 0:
        check_prompt(len(prompt_ids), runner.config.max_position_embeddings)
        return out.result(list(prompt_ids), 0.0, 0.0, "length")
    t0 = time.perf_counter()
    times, reason = [], "context"
    try:
        for token, _ in generate_step(runner, prompt_ids, sampler, logits_processors, cache):
            times.append(time.perf_counter())
            if token in eos:
                reason = "eos"
                break
            if out.add(token):
                reason = "stop"
                break
            if len(out.ids) >= max_tokens:
                reason = "length"
                break
    except KeyboardInterrupt:
        if not interruptible:
            raise
        reason = "interrupted"
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    rate = (len(times) - 1) / decode_s if decode_s > 0 else 0.0
    return out.result(list(prompt_ids), (times[0] - t0) * 1e3 if times else 0.0, rate, reason)


class _Collector:
    """Generated ids → text; finds stop strings and streams what is certain."""

    def __init__(self, stream: TextStream, stop: list[str], on_text: Callable[[str], None] | None):
        self.stream, self.stop, self.on_text = stream, stop, on_text
        self.ids: list[int] = []
        self.sent, self.cut = 0, None  # chars streamed so far; where a stop string starts

    def add(self, token: int) -> bool:
        """Take one token; True when a stop string has appeared."""
        self.ids.append(token)
        text = self.stream.text(self.ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.cut = min(hits)
            self._send(text[:self.cut])
            return True
        self._send(text[:len(text) - self._held(text)])
        return False

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            # counted as sent first: a Ctrl-C inside on_text must not stream the piece again
            piece, self.sent = text[self.sent:], len(text)
            if self.on_text is not None:
                self.on_text(piece)

    def result(self, prompt_ids: list[int], prefill_ms: float, rate: float, reason: str) -> GenerationResult:
        text = self.stream.text(self.ids, final=True)
        if self.cut is not None:
            text = text[:self.cut]
        self._send(text)
        return GenerationResult(prompt_ids, list(self.ids), text, prefill_ms, rate, reason)
