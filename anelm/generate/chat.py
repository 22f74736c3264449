"""Conversations: the prompts of a chat and the KV caches that carry them from turn to turn.

`History` keeps the messages of one conversation and drops its oldest turns when they outgrow
the context. A cache serves a new prompt up to the common prefix of the ids it holds and the
prompt (`reusable`): the template re-renders the whole conversation each turn, and a reply's
text may tokenize differently from the ids that were generated. `PromptCache` keeps a few
caches for a server, each with the ids it holds, and hands out the one that serves a prompt best.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..models.errors import InputError
from .runner import Cache, Runner


def reply_room(max_tokens: int, context: int) -> int:
    """The tokens a conversation keeps free for each reply: `max_tokens`, or half the context
    when `max_tokens` would leave no room for any message."""
    return min(max_tokens, context // 2)


class History:
    """The messages of a conversation, cut so that its prompt leaves `room` tokens for a reply."""

    def __init__(self, tok: Any, system: str | None, context: int, room: int):
        self.tok, self.context, self.room = tok, context, room
        self.head = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []  # user, assistant, user, ...: dropped a pair at a time
        self.dropped = 0  # messages the last `ask` dropped to fit
        if self.head and self._length([]) + room > context:
            raise InputError(f"the system message makes a prompt of {self._length([])} tokens; with room "
                             f"for a {room}-token reply it does not fit the context of {context}")

    def ask(self, line: str) -> list[int] | None:
        """The prompt ids for one more user line (None for a blank one), dropping the oldest
        turns when they do not fit with it (`dropped` says how many messages went); a line that
        cannot fit alone is refused."""
        self.dropped = 0
        if not line.strip():
            return None
        message = [{"role": "user", "content": line.strip()}]
        alone = self._length(message)
        if alone + self.room > self.context:
            raise InputError(f"the message was not sent: it makes a prompt of {alone} tokens, and with "
                             f"room for a {self.room}-token reply the context holds {self.context}")
        while self._length(self.turns + message) + self.room > self.context:
            del self.turns[:2]  # the oldest user message and its reply
            self.dropped += 2
        self.turns += message
        return self.tok.apply_chat_template(self.head + self.turns)

    def answer(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def withdraw(self) -> None:
        """Take back the last user message (its reply never began)."""
        self.turns.pop()

    def _length(self, turns: list[dict[str, str]]) -> int:
        return len(self.tok.apply_chat_template(self.head + turns))


def reusable(held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading positions of the cache serve the new prompt: the common prefix of the
    ids it holds and the prompt, short of the prompt's last token (which must run for logits)."""
    n = 0
    for a, b in zip(held, prompt[:-1]):
        if a != b:
            break
        n += 1
    return n


class PromptCache:
    """At most `max_entries` runner caches, each with the ids it holds, least recently used
    first. A request `take`s the cache that serves its prompt best, which leaves the store (one
    user at a time owns a cache), and `put`s it back when done. Device caches are large: the
    least recently used goes first, and a prompt that shares nothing with a full store reuses
    the oldest cache rather than making one more."""

    def __init__(self, runner: Runner, max_entries: int = 4):
        self.runner, self.max_entries = runner, max_entries
        self.entries: list[tuple[tuple[int, ...], Cache]] = []

    def take(self, prompt_ids: Sequence[int]) -> tuple[Cache, int]:
        """(cache, positions of the prompt it already holds): `cache.length` is set to those."""
        shared = [reusable(held, prompt_ids) for held, _ in self.entries]
        if shared and (max(shared) > 0 or len(self.entries) >= self.max_entries):
            n = max(shared)
            _, cache = self.entries.pop(shared.index(n))  # the least recently used among equals
        else:
            n, cache = 0, self.runner.new_cache()
        # a runner that predicts its times may start over where that is faster; the CPU
        # reference (and a test's stand-in) always resumes
        n = getattr(self.runner, "positions_to_reuse", lambda total, held: held)(len(prompt_ids), n)
        cache.length = n
        return cache, n

    def put(self, ids: Sequence[int], cache: Cache) -> None:
        """Give `cache` back after a generation: `ids` is the prompt and the generated tokens,
        of which the cache holds the first `cache.length`."""
        self.entries.append((tuple(ids[:cache.length]), cache))
        del self.entries[:max(0, len(self.entries) - self.max_entries)]

    def __len__(self) -> int:
        return len(self.entries)
