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
from typing import TYPE_CHECKING

from ..models.errors import InputError
from .common import utf8_problem, utf8_text
from .generate import add_model_args, load, notice, sampling, start, stream

if TYPE_CHECKING:
    from ..generate.chat import History


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--system", metavar="TEXT", type=utf8_text, help="a system message that opens the conversation")


def run(args: argparse.Namespace) -> int:
    from ..generate.chat import History, PromptCache, reply_room
    from ..generate.generate import generate
    from ..models.tokenizer.base import PLAIN_STOP

    opts = sampling(args)
    config, weights, tok = load(args)
    context = config.max_position_embeddings
    room = reply_room(args.max_tokens, context)
    if room < args.max_tokens:
        notice(f"--max-tokens {args.max_tokens} would fill the context of {context}: the conversation "
               f"keeps room for {room}-token replies")
    history = History(tok, args.system, context, room)
    runner = start(args, config, weights)
    if tok.chat_format() == "plain":
        opts["stop"].append(PLAIN_STOP)  # the model would go on to write the user's turn
    notice(f"chat ({tok.chat_format()} format); Ctrl-C stops a reply; end with Ctrl-D")
    caches = PromptCache(runner, max_entries=1)  # one conversation: its cache, and the ids it holds
    while True:
        try:
            print("> ", end="", file=sys.stderr, flush=True)
            line = read_line()
        except KeyboardInterrupt:
            line = None  # Ctrl-C at the prompt ends the chat, as Ctrl-D does
        if line is None:
            break
        try:
            prompt = ask(history, line)
        except InputError as e:
            print(f"anelm: error: {e}", file=sys.stderr, flush=True)
            continue
        if prompt is None:
            continue
        # each turn runs only what the cache does not hold (`anelm.generate.chat`)
        cache, _ = caches.take(prompt)
        res = generate(runner, tok, prompt, on_text=reply_stream(), cache=cache, interruptible=True, **opts)
        caches.put(list(prompt) + res.ids, cache)
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


def ask(history: History, line: str) -> list[int] | None:
    """`History.ask`, after the line is found to be UTF-8, with a notice for dropped turns."""
    problem = utf8_problem(line)
    if problem:
        raise InputError(f"the message was not sent: {problem}")
    prompt = history.ask(line)
    if history.dropped:
        kept = "the system message and " * bool(history.head) + f"the newest {len(history.turns)}"
        notice(f"the conversation outgrew the context of {history.context} tokens: dropped the oldest "
               f"{history.dropped} messages, kept {kept}")
    return prompt


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
