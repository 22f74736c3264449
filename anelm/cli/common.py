"""Flags and helpers shared by subcommands."""

from __future__ import annotations

import argparse


def add_run_folder_args(p: argparse.ArgumentParser) -> None:
    """--out and --resume, as every command that writes a run folder (train, finetune) takes them."""
    p.add_argument("--out", default=None, metavar="RUN",
                   help="run folder (default: runs/<timestamp>; required with --resume)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint, towards the same --steps")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["auto", "ane", "emulator"], default="auto",
                   help="where programs run: the real ANE, the emulator, or the best available (default)")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="chip-profile JSON (default: $ANELM_PROFILE, else the built-in 'strict')")


def add_adapter_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", metavar="DIR", default=None,
                   help="run with a LoRA adapter: a finetune RUN folder or a PEFT LoRA folder for this base")


def check_before_loading(args, device: bool = True) -> None:
    """The flags that need no model, checked before one loads (seconds on a real model, which
    a typo would otherwise cost): --device ane off a machine without it (when the command will
    ask for a `device`), a missing --adapter."""
    if device and getattr(args, "device", None) == "ane":
        from ..device.ane import available
        from ..errors import DeviceError

        ok, reason = available()  # what get_device asks first; the self-test waits until then
        if not ok:
            raise DeviceError(f"--device ane requested but the Apple Neural Engine is unavailable: "
                              f"{str(reason).splitlines()[0] if reason else 'unavailable'}")
    if getattr(args, "adapter", None) is not None:
        from pathlib import Path

        from ..models.adapters import AdapterError  # first: formats.peft imports from it
        from ..models.formats.peft import adapter_folder

        if not Path(args.adapter).exists():
            raise AdapterError(f"--adapter {args.adapter} does not exist: expected a PEFT LoRA folder or a "
                               "finetune RUN folder (RUN/adapter/)")
        adapter_folder(args.adapter)  # a folder without adapter_config.json


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Data-parallel training flags (docs/distributed.md), shared by train and finetune."""
    p.add_argument("--distributed", action="store_true",
                   help="one rank of a data-parallel job (torchrun, or RANK, WORLD_SIZE, MASTER_ADDR, "
                        "MASTER_PORT set by another launcher); needs pip install 'anelm[distributed]'")
    p.add_argument("--dist-timeout", type=positive_float, default=300.0, metavar="S",
                   help="seconds a rank waits for the others before it stops with an error naming "
                        "the lost rank (default: 300)")


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def device_from_args(args):
    """The device and profile the user asked for; the choice is printed to stderr."""
    from ..chip.profile import load_profile
    from ..device.select import get_device

    profile = load_profile(args.profile)
    return get_device(args.device, profile), profile


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def utf8_problem(text: str) -> str | None:
    """What makes `text` not UTF-8, or None. Bytes that are not UTF-8 reach Python as lone
    surrogates (PEP 383): in sys.argv, and in stdin lines decoded with surrogateescape."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        return f"{what} at character {e.start} is not UTF-8; expected UTF-8 text"


def utf8_text(text: str) -> str:
    """argparse type of free-text flags (a prompt, a system message): UTF-8 or a usage error."""
    problem = utf8_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text
