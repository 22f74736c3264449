"""`anelm chat`: a conversation with a model, one user line at a time from stdin.

The prompt is the tokenizer's chat template when it has one (and jinja2 is installed), else
plain `User:` / `Assistant:` lines. One KV cache carries the conversation: each turn runs only
the tokens that follow what it already holds. Replies stream to stdout; the `> ` prompt and
notices go to stderr, so stdout holds only what the model said.
"""

from __future__ import annotations

import argparse
import sys

from .generate import add_model_args, load, notice, sampling, start, stream


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")


def run(args: argparse.Namespace) -> int:
    from ..generate.generate import generate
    from ..models.tokenizer import PLAIN_STOP

    opts = sampling(args)
    config, weights, tok = load(args)
    runner = start(args, config, weights)
    if tok.chat_format() == "plain":
        opts["stop"].append(PLAIN_STOP)  # the model would go on to write the user's turn
    notice(f"chat ({tok.chat_format()} format); end with Ctrl-D")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    cache, held = runner.new_cache(), []  # the conversation so far, whose keys and values are cached
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        prompt = tok.apply_chat_template(messages)
        # each turn runs only what the cache does not hold: the template re-renders the whole
        # conversation, and the reply's text may tokenize differently from the ids generated
        cache.length = reusable(held, prompt)
        res = generate(runner, tok, prompt, on_text=reply_stream(), cache=cache, **opts)
        held = (list(prompt) + res.ids)[:cache.length]
        stream("\n")
        messages.append({"role": "assistant", "content": res.text.strip()})
    print(file=sys.stderr)
    return 0


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
