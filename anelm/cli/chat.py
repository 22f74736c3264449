"""`anelm chat`: a conversation with a model, one user line at a time from stdin.

The prompt is the tokenizer's chat template when it has one (and jinja2 is installed), else
plain `User:` / `Assistant:` lines. One KV cache carries the conversation: each turn runs only
the tokens that follow what it already holds. Replies stream to stdout; the `> ` prompt and
notices go to stderr, so stdout holds only what the model said.

When the conversation outgrows the context, the oldest turns are dropped (the system message
stays) and a notice says so; the cache keeps what still prefixes the shorter prompt and the
rest is prefilled again. A message that cannot fit even alone is refused with one error line,
and the conversation goes on, as it does after a line that is not UTF-8: a user retypes a
message, and should not lose the conversation over it.

Ctrl-C during a reply stops that reply, as in llama.cpp and mlx-lm: what it said so far stays in
the conversation (the user saw it, the cache holds it, and the next message may well refer to
it); a reply stopped before its first token withdraws the message. Ctrl-C at the prompt, or
Ctrl-D, ends the chat. A reply cut at --max-tokens or at the context's end says so on stderr.
"""

from __future__ import annotations

import argparse
import sys

from ..models.errors import InputError
from .common import utf8_problem, utf8_text
from .generate import add_model_args, load, notice, sampling, start, stream


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--system", metavar="TEXT", type=utf8_text, help="a system message that opens the conversation")


def run(args: argparse.Namespace) -> int:
    from ..generate.generate import generate
    from ..models.tokenizer import PLAIN_STOP

    opts = sampling(args)
    config, weights, tok = load(args)
    history = History(tok, args.system, config.max_position_embeddings, args.max_tokens)
    runner = start(args, config, weights)
    if tok.chat_format() == "plain":
        opts["stop"].append(PLAIN_STOP)  # the model would go on to write the user's turn
    notice(f"chat ({tok.chat_format()} format); Ctrl-C stops a reply; end with Ctrl-D")
    cache, held = runner.new_cache(), []  # the conversation so far, whose keys and values are cached
    while True:
        try:
            print("> ", end="", file=sys.stderr, flush=True)
            line = read_line()
        except KeyboardInterrupt:
            line = None  # Ctrl-C at the prompt ends the chat, as Ctrl-D does
        if line is None:
            break
        try:
            prompt = history.ask(line)
        except InputError as e:
            print(f"anelm: error: {e}", file=sys.stderr, flush=True)
            continue
        if prompt is None:
            continue
        # each turn runs only what the cache does not hold: the template re-renders the whole
        # conversation, and the reply's text may tokenize differently from the ids generated
        cache.length = reusable(held, prompt)
        res = generate(runner, tok, prompt, on_text=reply_stream(), cache=cache, interruptible=True, **opts)
        held = (list(prompt) + res.ids)[:cache.length]
        stream("\n")
        if res.finish_reason == "interrupted" and not res.ids:
            history.withdraw()
            notice("stopped before the reply began: the message was withdrawn")
            continue
        if res.finish_reason in CUT:
            notice(CUT[res.finish_reason].format(n=args.max_tokens, context=cache.capacity))
        history.answer(res.text.strip())
    print(file=sys.stderr)
    return 0


CUT = {"interrupted": "reply stopped (Ctrl-C); Ctrl-C at the prompt or Ctrl-D ends the chat",
       "length": "reply cut at --max-tokens {n}",
       "context": "reply cut at the end of the context ({context} tokens)"}


def read_line() -> str | None:
    """The next stdin line, or None at its end. Read as bytes where stdin has them, so a line
    that is not UTF-8 arrives (surrogate-escaped) for `History.ask` to refuse, instead of
    failing the read itself."""
    buffer = getattr(sys.stdin, "buffer", None)
    line = buffer.readline().decode("utf-8", "surrogateescape") if buffer is not None else sys.stdin.readline()
    return line or None


class History:
    """The messages of a conversation, cut so that its prompt leaves room for a reply."""

    def __init__(self, tok, system: str | None, context: int, max_tokens: int):
        self.tok, self.context = tok, context
        self.head = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []  # user, assistant, user, ...: dropped a pair at a time
        # a --max-tokens as long as the context would leave no room for any message: keep half
        self.room = min(max_tokens, context // 2)
        if self.room < max_tokens:
            notice(f"--max-tokens {max_tokens} would fill the context of {context}: the conversation "
                   f"keeps room for {self.room}-token replies")
        if self.head and self._length([]) + self.room > context:
            raise InputError(f"the system message makes a prompt of {self._length([])} tokens; with room "
                             f"for a {self.room}-token reply it does not fit the context of {context}")

    def ask(self, line: str) -> list[int] | None:
        """The prompt ids for one more user line (None for a blank one), dropping the oldest
        turns when they do not fit with it; a line that cannot fit alone is refused."""
        problem = utf8_problem(line)
        if problem:
            raise InputError(f"the message was not sent: {problem}")
        if not line.strip():
            return None
        message = [{"role": "user", "content": line.strip()}]
        alone = self._length(message)
        if alone + self.room > self.context:
            raise InputError(f"the message was not sent: it makes a prompt of {alone} tokens, and with "
                             f"room for a {self.room}-token reply the context holds {self.context}")
        dropped = 0
        while self._length(self.turns + message) + self.room > self.context:
            del self.turns[:2]  # the oldest user message and its reply
            dropped += 2
        self.turns += message
        if dropped:
            kept = "the system message and " * bool(self.head) + f"the newest {len(self.turns)}"
            notice(f"the conversation outgrew the context of {self.context} tokens: dropped the oldest "
                   f"{dropped} messages, kept {kept}")
        return self.tok.apply_chat_template(self.head + self.turns)

    def answer(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def withdraw(self) -> None:
        """Take back the last user message (its reply never began)."""
        self.turns.pop()

    def _length(self, turns: list[dict[str, str]]) -> int:
        return len(self.tok.apply_chat_template(self.head + turns))


def reusable(held: list[int], prompt: list[int]) -> int:
    """How many leading positions of the cache serve the new prompt: the common prefix of the
    ids it holds and the prompt, short of the prompt's last token (which must run for logits)."""
    n = 0
    for a, b in zip(held, prompt[:-1]):
        if a != b:
            break
        n += 1
    return n


def reply_stream():
    """Streams one reply without the whitespace it starts with (it continues the prompt's text)."""
    started = False

    def on_text(piece: str) -> None:
        nonlocal started
        if not started:
            piece = piece.lstrip()
            started = bool(piece)
        if piece:
            stream(piece)

    return on_text
