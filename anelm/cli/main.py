"""`anelm <subcommand>`: each subcommand is a module here with `add_args(p)` and `run(args) -> int`.

Bad input is one line on stderr, `anelm: error: ...`, exit 2 for usage and 1 otherwise;
`ANELM_DEBUG=1` shows the traceback instead. Python warnings that anelm raises print as
`anelm: warning: ...`, like every other notice.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import warnings
from collections.abc import Collection
from pathlib import Path

from ..errors import AnelmError, UsageError

# subcommand -> (module, one-line help); the order is the order of `anelm --help`.
SUBCOMMANDS = {
    "compile": ("compile", "compile transformer kernels to kernel folders (MIL + BLOBFILE weights)"),
    "run-mil": ("run_mil", "execute a kernel folder (model.mil + weights/) on a device"),
    "train": ("train", "train a Llama-family model (forward + dx on the device, the rest on the CPU)"),
    "finetune": ("finetune", "LoRA fine-tuning of a frozen base model (adapters in PEFT's layout)"),
    "export": ("export", "export a training run as a Hugging Face folder"),
    "generate": ("generate", "generate text from a model"),
    "chat": ("chat", "chat with a model"),
    "serve": ("serve", "serve a model over the OpenAI API (chat and text completions, streaming)"),
    "perplexity": ("perplexity", "score a text file with a model: perplexity and next-token choices"),
    "quantize": ("quantize", "weights to int8 (w8, w8a8), 4-bit blocks (w4) or lookup tables (lut4, lut6), scored"),
    "doctor": ("doctor", "report the machine and devices; run the hardware conformance suite"),
    "demo": ("demo", "compile a small transformer layer and run it on the best device"),
    "bench": ("bench", "predict ANE time from the compiled programs (cost model) and measure beside it"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in the project's one-line form (exit 2)."""

    def error(self, message: str):
        # "anelm: error: " already names the program; a subcommand adds only its own name
        command = self.prog.removeprefix("anelm").strip()
        raise UsageError(f"{command}: {message}" if command else message)


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI's parser; only the subcommands in `commands` (default: all) get their
    options, which imports their modules: `main` builds the one it runs, so `anelm --help`
    and each command import only what they use (all of them together took ~1.8 s)."""
    # allow_abbrev=False: `--max` is an unknown option, not a guess at `--max-tokens`
    p = _Parser(prog="anelm", description="Train and run language models on the Apple Neural Engine.",
                allow_abbrev=False)
    from .. import __version__

    p.add_argument("--version", action="version", version=f"anelm {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        if commands is not None and name not in commands:
            continue
        try:
            mod = importlib.import_module(f"anelm.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"anelm.cli.{module}":
                raise
            sp.set_defaults(_unavailable=name)
            continue
        mod.add_args(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        _shown.clear()
        try:
            return _main(argv)
        finally:
            gc.unfreeze()  # what a command froze (`generate.start`) is collectable again once it returns


def _main(argv: list[str]) -> int:
    try:
        # the command is the first word: the top level has no option that takes a value
        parser = build_parser(commands=[a for a in argv[:1] if a in SUBCOMMANDS])
        args = parser.parse_args(argv)
        if getattr(args, "command", None) is None:
            parser.print_help(sys.stderr)
            return 2
        if getattr(args, "_unavailable", None):
            raise AnelmError(f"'{args._unavailable}' is not available in this build")
        from ..caches import warn_if_unwritable

        warn_if_unwritable()
        _from_hub(args)
        return int(args._run(args) or 0)
    except UsageError as e:
        return _fail(e, 2)
    except AnelmError as e:
        return _fail(e, 1)
    except KeyboardInterrupt:
        print("anelm: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, MemoryError) as e:
        return _fail(e, 1)


def _from_hub(args: argparse.Namespace) -> None:
    """A model named by its HF repo id (`owner/name`, `owner/name:FILE.gguf`: `--model`, and
    `--init-from`) is its path in the HF cache from here on (`models/hub.py`), so every command
    reads a local path; a served model keeps the repo id as its name."""
    for attr in ("model", "init_from"):
        spec = getattr(args, attr, None)
        if isinstance(spec, str) and not Path(spec).exists():
            from ..models.hub import resolve

            local = resolve(spec)
            if local is not None:
                if getattr(args, "model_id", False) is None:
                    args.model_id = spec
                setattr(args, attr, str(local))


PACKAGE_DIR = Path(__file__).resolve().parents[1]
_show_other_warning = warnings.showwarning  # third-party warnings keep Python's own format
# notices already printed by this command: Python's once-per-place rule forgets them whenever a
# library touches the warning filters, and a real model's 60 programs would repeat one 60 times
_shown: set[str] = set()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning raised in anelm's code is one notice line; others print as Python prints them."""
    if not Path(filename).resolve().is_relative_to(PACKAGE_DIR):
        return _show_other_warning(message, category, filename, lineno, file, line)
    text = str(message).splitlines()[0] if str(message) else category.__name__
    if text in _shown:
        return
    _shown.add(text)
    line = f"anelm: warning: {text}"
    tqdm = sys.modules.get("tqdm")
    if file is None and tqdm is not None:
        tqdm.tqdm.write(line, file=sys.stderr)  # above a live progress bar, not into it
    else:
        print(line, file=sys.stderr if file is None else file, flush=True)


def _fail(e: BaseException, code: int) -> int:
    if os.environ.get("ANELM_DEBUG"):
        raise e
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(f"anelm: error: {msg}", file=sys.stderr)
    return code
