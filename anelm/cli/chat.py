"""`anelm chat`: a conversation with a model, one user line at a time from stdin.

The prompt is the tokenizer's chat template when it has one (and jinja2 is installed), else
plain `User:` / `Assistant:` lines. Replies stream to stdout; the `> ` prompt and notices go
to stderr, so stdout holds only what the model said.
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
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        res = generate(runner, tok, tok.apply_chat_template(messages), on_text=reply_stream(), **opts)
        stream("\n")
        messages.append({"role": "assistant", "content": res.text.strip()})
    print(file=sys.stderr)
    return 0


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
