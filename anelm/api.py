"""The Python API: load a model, generate text with it, stream it, fine-tune it.

    import anelm

    model = anelm.load("smollm2-135m-instruct-q4_1.gguf", max_context=256)
    print(anelm.generate(model, "Once upon a time", max_tokens=32))          # greedy by default
    for piece in anelm.stream_generate(model, [{"role": "user", "content": "Hi!"}], max_tokens=32):
        print(piece, end="", flush=True)                                      # a chat, streamed
    run = anelm.finetune("smollm2-135m-instruct-q4_1.gguf", "examples/facts", steps=30, out="runs/facts")
    tuned = anelm.load("smollm2-135m-instruct-q4_1.gguf", adapter=run / "best")

Each function is a thin layer over what the commands run, so the two give the same results:
`load` is `anelm.generate.engine.load_engine` (the loaders and the device runner of
`anelm generate`; an HF repo id is resolved as `--model` resolves it), `generate` and
`stream_generate` are `anelm.generate.generate.stream_generate` on that runner, and
`finetune` is `anelm finetune` with its flags as keyword arguments. Nothing heavy is imported
until a function is called: `import anelm` stays light.
"""

from __future__ import annotations

import argparse
import numbers
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

if TYPE_CHECKING:
    from .generate.engine import Engine

# a plain text (completed as is), a conversation (run through the model's chat template) or token ids
Prompt = Union[str, Sequence[dict], Sequence[int]]


def load(path_or_repo: str | os.PathLike, adapter: str | os.PathLike | None = None, *,
         device: str = "auto", profile: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
         max_context: int | None = None, verbose: bool = False) -> Engine:
    """Load a model and start its runner; returns an `Engine` (`anelm.generate.engine`):
    `.tokenizer`, `.config` (HF field names), `.runner` (`.runner.device` is "ane",
    "emulator" or "cpu"), `.context` (the positions one generation may hold).

    path_or_repo  an HF folder (safetensors), a .gguf file, a llama2.c .bin, a training RUN
                  folder, a folder of `anelm quantize`, or an HF repo id (`owner/name`, or
                  `owner/name:FILE.gguf`) read through the HF cache
    adapter       a LoRA adapter: a PEFT folder, or a finetune RUN folder (`RUN/adapter`, `RUN/best`)
    device        "auto" (the ANE when the machine has one, else the emulator), "ane" or "emulator"
    profile       a chip-profile JSON (default: $ANELM_PROFILE, else the built-in `strict`)
    tokenizer     a tokenizer file or folder in place of the model's
    max_context   the most positions a generation holds (prompt + new tokens); fewer positions
                  mean smaller device programs, built and run faster (default: the model's context)
    verbose       print the notices `anelm generate` prints (model, adapter) on stderr; the
                  device's choice is noted on stderr either way, as the commands note it

    Errors are `anelm.errors.AnelmError` subclasses with a one-line message (a missing file,
    an architecture anelm does not run, `device="ane"` off a Mac).
    """
    from .generate.engine import load_engine
    from .models.hub import resolve

    spec = os.fspath(path_or_repo)
    if not Path(spec).exists():
        local = resolve(spec)  # None: not a repo id; the loader then says what is missing
        spec = os.fspath(local) if local is not None else spec
    return load_engine(spec, tokenizer=tokenizer, adapter=adapter, device=device, profile=profile,
                       max_context=max_context, model_id=os.fspath(path_or_repo),
                       notice=_print if verbose else _quiet)


def generate(model: Engine, prompt: Prompt, *, max_tokens: int | None = 128, temperature: float = 0.0,
             verbose: bool = False, **options: Any) -> str:
    """The text generated for `prompt`, up to `max_tokens` tokens (None: until EOS, a stop
    string or the end of the context), greedy at `temperature` 0 (the default).

    prompt   a string (continued as `anelm generate --prompt` continues it), a list of chat
             messages ({"role": ..., "content": ...}, through the model's chat template, ready
             for the assistant's turn), or a list of token ids
    options  the rest of OpenAI's sampling fields (`anelm.generate.sampling.SamplingOptions`):
             top_p, top_k, min_p, seed, stop (a list of strings), presence_penalty,
             frequency_penalty, repetition_penalty, logit_bias
    verbose  print the text to stdout as it comes

    Greedy output equals `anelm generate --temperature 0` for the same model, prompt and
    max_tokens. Each call starts from an empty cache.
    """
    pieces = []
    for piece in stream_generate(model, prompt, max_tokens=max_tokens, temperature=temperature, **options):
        pieces.append(piece)
        if verbose:
            print(piece, end="", flush=True)
    if verbose:
        print()
    return "".join(pieces)


def stream_generate(model: Engine, prompt: Prompt, *, max_tokens: int | None = 128, temperature: float = 0.0,
                    **options: Any) -> Iterator[str]:
    """`generate`, piece by piece: yields the text as it becomes certain (a piece never splits
    a UTF-8 character nor shows the start of a stop string that may still complete). The
    options are checked before any work; the next token is computed only when asked for, so
    leaving the loop early costs nothing."""
    from .generate.sampling import SamplingOptions

    ids = _prompt_ids(model, prompt)
    opts = SamplingOptions(max_tokens=max_tokens, temperature=temperature, **options)
    opts = opts.check(getattr(model.config, "vocab_size", None))
    for delta in model.stream(ids, opts):
        if delta.text:
            yield delta.text


def finetune(model: str | os.PathLike | None, data: str | os.PathLike | None = None, *,
             out: str | os.PathLike | None = None, **settings: Any) -> Path:
    """LoRA fine-tuning of a frozen base, as `anelm finetune` runs it; returns the run folder.

    model     the base: an HF folder, a RUN folder, a .gguf file or an HF repo id (None with
              `resume=True`: the run's own)
    data      a text file, a folder of .txt files, or chat JSONL (a .jsonl file, or a folder
              holding train.jsonl and valid.jsonl: the loss is over the answers only)
    out       the run folder (default: runs/<timestamp>, as the command's)
    settings  the command's flags under their Python names, e.g. steps=30, batch_size=2,
              seq_len=128, lr=3e-3, rank=16, alpha=32, dropout=0.05, targets="all-linear",
              eval_every=10, patience=3, pack=False, train_on_prompt=True, resume=True,
              device="emulator", profile=..., seed=0 (`anelm finetune --help` lists them all)

    The run folder holds `metrics.jsonl`, checkpoints, `adapter/` (the latest adapter, PEFT's
    layout) and, with JSONL data and an eval, `best/` (the adapter at the lowest eval loss):
    `anelm.load(base, adapter=run / "best")` runs it. Bad settings raise `UsageError` before
    anything loads, as the command's flags do.
    """
    from .cli import finetune as command
    from .cli.main import _from_hub
    from .errors import UsageError

    parser = _Parser(prog="finetune", allow_abbrev=False)
    command.add_args(parser)
    out = os.fspath(out) if out is not None else os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    values = {"init_from": model, "data": data, "out": out, **settings}
    argv = []
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    for name, value in values.items():
        action = actions.get(name)
        if action is None or name == "help":
            raise UsageError(f"finetune: unknown setting {name!r}; expected one of "
                             f"{', '.join(sorted(d for d in actions if d != 'help'))}")
        if value is None:
            continue
        if action.nargs == 0:  # a flag: given when the value asks for what it sets
            if bool(value) == bool(action.const):
                argv.append(action.option_strings[0])
            continue
        argv.append(f"{action.option_strings[0]}={os.fspath(value) if isinstance(value, os.PathLike) else value}")
    args = parser.parse_args(argv)
    _from_hub(args)
    code = command.run(args)
    if code:
        from .errors import AnelmError

        raise AnelmError(f"finetune ended with status {code}")
    return Path(args.out)


def _prompt_ids(model: Engine, prompt: Prompt) -> list[int]:
    from .errors import UsageError

    if isinstance(prompt, str):
        return model.completion_prompt(prompt)
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        return model.chat_prompt(items)
    if items and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items):
        return [int(t) for t in items]
    raise UsageError("prompt: expected a string, a list of chat messages ({'role': ..., 'content': ...}) "
                     "or a non-empty list of token ids")


class _Parser(argparse.ArgumentParser):
    """The command's flags, bad values raised as `UsageError` (argparse would exit)."""

    def error(self, message: str):
        from .errors import UsageError

        raise UsageError(f"finetune: {message}")


def _print(msg: str) -> None:
    import sys

    print(f"anelm: {msg}", file=sys.stderr, flush=True)


def _quiet(msg: str) -> None:
    pass


def supported_models() -> str:
    """The supported-models tables of README.md (markdown): every architecture of the registry
    (`anelm/models/registry.py`) with its formats and commands, then every model format."""
    from .kernels.families import family_for
    from .models.support import markdown
    from .train.presets import PRESETS

    def family(model_type: str):
        try:
            return family_for(model_type)
        except KeyError:  # an architecture whose layers no family builds yet
            return None

    presets: dict[str, list[str]] = {}
    for name, config in PRESETS.items():
        presets.setdefault(config["model_type"], []).append(name)
    return markdown(family, presets)
