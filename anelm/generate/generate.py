"""Generation: `generate_step` yields (token, logprobs); `stream_generate` adds the stopping
rules and yields the text as it becomes certain (`Delta`s); `generate` collects one stream, with
its timing.

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
from .sampling import LogitsProcessor, Sampler, SamplingOptions, check_sampling, greedy


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float32) - np.max(logits)
    return z - np.log(np.sum(np.exp(z)))


def generate_step(runner: Runner, prompt_ids: Sequence[int], sampler: Sampler = greedy,
                  logits_processors: Sequence[LogitsProcessor] = (), cache: Cache | None = None
                  ) -> Iterator[tuple[int, np.ndarray]]:
    """Prefill the prompt, then yield (token, logprobs [V]) forever, or until the context is full.

    `logprobs` are the model's (the log-softmax of the runner's logits); the sampler draws from
    the log-softmax of the logits that the processors made. A processor with an `advance(token)`
    method (a grammar that follows the text) is told each token as it is sampled.
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
    advance = [p.advance for p in logits_processors if hasattr(p, "advance")]
    while True:
        logprobs = log_softmax(logits)
        for process in logits_processors:
            logits = process(tokens, logits)
        token = int(sampler(log_softmax(logits) if logits_processors else logprobs))
        for step in advance:
            step(token)
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


# Why a stream ended, as `Delta.finish_reason` and `GenerationResult.finish_reason` say it, and
# as OpenAI's API does: "eos" (the model's end of text) and "stop" (a stop string) are its
# "stop"; "length" (max_tokens) and "context" (the model's context is full) its "length";
# "interrupted" (Ctrl-C, where the caller allows it) has no OpenAI name and reads as "stop".
OPENAI_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
                         "interrupted": "stop"}


@dataclass(frozen=True)
class Delta:
    """One step of a stream: a generated token with the text that became certain with it, or,
    last, the end (token None, finish_reason set) with the text still held back."""

    text: str  # "" while a character's bytes or a possible stop string are incomplete
    token: int | None
    logprob: float | None  # the model's log-probability of `token`, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] | None  # (token, logprob) of the likeliest, likeliest first
    finish_reason: str | None  # see OPENAI_FINISH_REASONS


def stream_generate(runner: Runner, tokenizer: Any, prompt_ids: Sequence[int], options: SamplingOptions, *,
                    cache: Cache | None = None, eos_ids: Sequence[int] | None = None,
                    logits_processors: Sequence[LogitsProcessor] = (), interruptible: bool = False
                    ) -> Iterator[Delta]:
    """The Deltas of one generation under `options` (checked now, before any work): one per
    token, then the end. It stops at EOS (the model's and the tokenizer's, or `eos_ids`), at a
    stop string, after `options.max_tokens` or at the end of the context.

    `logits_processors` run after the options' own, just before sampling (a grammar's mask).
    `cache`: see `generate_step`; it holds the first `cache.length` of prompt + generated ids,
    whenever the consumer stops iterating. `interruptible`: a KeyboardInterrupt, in the runner
    or thrown in at a yield, ends the stream with "interrupted" instead of propagating.
    """
    options.check(getattr(runner.config, "vocab_size", None))
    processors = options.processors(len(prompt_ids)) + list(logits_processors)
    top = options.top_logprobs if options.logprobs else None
    return _deltas(runner, tokenizer, prompt_ids, options.sampler(), processors, options.stop,
                   options.max_tokens, eos_ids, cache, interruptible, top)


def _deltas(runner: Runner, tokenizer: Any, prompt_ids: Sequence[int], sampler: Sampler,
            processors: Sequence[LogitsProcessor], stop: Sequence[str], max_tokens: int | None,
            eos_ids: Sequence[int] | None, cache: Cache | None, interruptible: bool, top: int | None
            ) -> Iterator[Delta]:
    """The stopping rules, for `stream_generate` and `generate`; `top`: how many top logprobs
    each Delta reports (None: no logprobs)."""
    eos = set(runner.config.eos_ids if eos_ids is None else eos_ids)
    if eos_ids is None and getattr(tokenizer, "eos_id", None) is not None:
        eos.add(tokenizer.eos_id)
    text = _Text(TextStream(tokenizer, prompt_ids), [s for s in stop if s])
    if max_tokens == 0:
        check_prompt(len(prompt_ids), runner.config.max_position_embeddings)
        yield text.end("length")
        return
    reason = "context"
    try:
        for token, logprobs in generate_step(runner, prompt_ids, sampler, processors, cache):
            if token in eos:
                reason = "eos"
                break
            piece, stopped = text.add(token)
            yield Delta(piece, token, *_logprobs(logprobs, token, top), None)
            if stopped or (max_tokens is not None and len(text.ids) >= max_tokens):
                reason = "stop" if stopped else "length"
                break
    except KeyboardInterrupt:
        if not interruptible:
            raise
        reason = "interrupted"
    yield text.end(reason)


def _logprobs(logprobs: np.ndarray, token: int, top: int | None) -> tuple[float | None, list | None]:
    if top is None:
        return None, None
    n = min(top, logprobs.size)
    best = np.argpartition(-logprobs, n - 1)[:n] if n else np.arange(0)
    best = best[np.lexsort((best, -logprobs[best]))]  # likeliest first, lower ids first on ties
    return float(logprobs[token]), [(int(i), float(logprobs[i])) for i in best]


class _Text:
    """Generated ids → the text that is certain so far; finds stop strings."""

    def __init__(self, stream: TextStream, stop: list[str]):
        self.stream, self.stop = stream, stop
        self.ids: list[int] = []
        self.sent, self.cut = 0, None  # chars handed out so far; where a stop string starts

    def add(self, token: int) -> tuple[str, bool]:
        """Take one token: the text it made certain, and whether a stop string has appeared."""
        self.ids.append(token)
        text = self.stream.text(self.ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.cut = min(hits)
            return self._take(text[:self.cut]), True
        return self._take(text[:len(text) - self._held(text)]), False

    def end(self, reason: str) -> Delta:
        text = self.stream.text(self.ids, final=True)
        return Delta(self._take(text if self.cut is None else text[:self.cut]), None, None, None, reason)

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)

    def _take(self, text: str) -> str:
        if len(text) <= self.sent:
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece


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
    stream = _deltas(runner, tokenizer, prompt_ids, sampler, logits_processors, stop, max_tokens,
                     eos_ids, cache, interruptible, None)
    ids, texts, times = [], [], []
    t0 = time.perf_counter()
    delta = next(stream)
    while True:
        if delta.token is not None or delta.finish_reason == "eos":
            times.append(time.perf_counter())  # each token sampled, the EOS included
        if delta.token is not None:
            ids.append(delta.token)
        texts.append(delta.text)
        try:
            if on_text is not None and delta.text:
                on_text(delta.text)
        except KeyboardInterrupt:
            if not interruptible or delta.finish_reason is not None:
                raise
            delta = stream.throw(KeyboardInterrupt())  # ends the stream as a Ctrl-C in decode would
            continue
        if delta.finish_reason is not None:
            break
        delta = next(stream)
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    rate = (len(times) - 1) / decode_s if decode_s > 0 else 0.0
    prefill_ms = (times[0] - t0) * 1e3 if times else 0.0
    return GenerationResult(list(prompt_ids), ids, "".join(texts), prefill_ms, rate, delta.finish_reason)
