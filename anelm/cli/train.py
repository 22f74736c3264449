"""`anelm train`: train a Llama-family model, forward and dx on the device, the rest on the CPU.

    anelm train                                   # tiny on the built-in stories, --device auto
    anelm train --preset stories15m --data tinystories.bin --tokenizer tokenizer.model
    anelm train --out runs/a --resume             # continue a run (killed or finished)
    anelm train --init-from ~/models/SmolLM-135M --data notes.txt --steps 200
    torchrun --nproc-per-node 2 -m anelm train --distributed --out runs/dp   # data-parallel

The run folder (docs/training.md) gets config.json, the tokenizer, metrics.jsonl, loss.png and
checkpoints. Progress and notices go to stderr; the sample generated at the end goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import fields

from .common import (add_device_args, add_distributed_args, add_run_folder_args, check_before_loading,
                     positive_int)


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got '{text}'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _number(text: str, positive: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v == v and abs(v) != float("inf")) or v < 0 or (positive and v == 0):
        want = "a positive number" if positive else "a number >= 0"
        raise argparse.ArgumentTypeError(f"expected {want}, got '{text}'")
    return v


def _type(f):
    """argparse type of a settings field, from its annotation and `kind` metadata."""
    kind = f.metadata.get("kind")
    is_float = "float" in str(f.type)
    if kind == "positive":
        return (lambda t: _number(t, True)) if is_float else positive_int
    if kind == "nonneg":
        return (lambda t: _number(t, False)) if is_float else _nonneg_int
    if kind == "int":
        return int
    return str


def add_settings_args(p: argparse.ArgumentParser, skip=(), defaults: dict | None = None) -> None:
    """One flag per training setting (`TrainSettings`), but those in `skip`; `defaults` are
    the ones a command puts in place of the field defaults (shown in the help)."""
    from ..train.presets import TRAIN_DEFAULTS
    from ..train.settings import TrainSettings

    per_preset = set() if defaults is not None else {k for d in TRAIN_DEFAULTS.values() for k in d}
    for f in fields(TrainSettings):
        if f.name in skip:
            continue
        value = (defaults or {}).get(f.name, f.default)
        default = ""
        if value is not None and "default" not in f.metadata["help"]:
            default = f" (default: {'per preset, else ' if f.name in per_preset else ''}{value})"
        if f.metadata.get("kind") == "flag":  # --train-on-prompt, --no-pack: the opposite of the default
            p.add_argument(f.metadata.get("flag") or "--" + f.name.replace("_", "-"), dest=f.name, default=None,
                           action="store_const", const=not f.default, help=f.metadata["help"])
            continue
        kw = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
        if not kw:
            kw["metavar"] = f.metadata.get("metavar") or (
                "X" if "float" in str(f.type) else "N" if f.metadata.get("kind") else f.name.upper())
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, type=_type(f),
                       help=f.metadata["help"] + default, **kw)


def add_args(p: argparse.ArgumentParser) -> None:
    add_settings_args(p)
    add_run_folder_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the predicted step time per chip (anelm bench's cost model) and exit; compiles nothing on a device")
    add_device_args(p)
    add_distributed_args(p)


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        from ..bench.dry_run import dry_run
        from ..train.settings import TrainSettings

        return dry_run({n: getattr(args, n) for n in TrainSettings.names()})
    from ..chip.profile import load_profile
    from ..device.select import get_device
    from ..errors import UsageError
    from ..train.run import prepare
    from ..train.settings import TrainSettings

    if args.resume and not args.out:
        raise UsageError("--resume needs --out RUN: the run folder to continue")
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    profile = load_profile(args.profile)  # a bad profile fails before any work
    check_before_loading(args)  # and --device ane off a Mac, before a model or the data load
    explicit = {n: getattr(args, n) for n in TrainSettings.names()}
    if not args.distributed:
        return _train(args, profile, prepare(explicit, out, args.resume), None)
    from ..train.distributed.setup import share_setup
    from ..train.distributed import join

    if explicit.get("pipeline") == "static" and profile.compile_budget:
        raise UsageError("--distributed needs --pipeline dynamic: the static pipeline restarts its "
                         "process when the compile budget runs out, which would leave the job")
    group = join(args.dist_timeout)
    try:
        return _train(args, profile, share_setup(group, lambda: prepare(explicit, out, args.resume)), group)
    finally:
        group.close()


def _train(args, profile, setup, group, sample_from=None, **trainer_kw) -> int:
    """Run the trainer on `setup` (`trainer_kw`: Trainer options, e.g. finetune's step factory);
    `sample_from(setup)`: the setup whose weights write the end sample (default: `setup`)."""
    from ..device.select import get_device
    from ..train.loop import Trainer
    from ..train.report import sample_text, summary

    ck, main = setup.checkpoint, group is None or group.is_main
    if ck is not None and ck.step >= setup.args.steps and not ck.extra.get("pending_eval"):
        if main:
            _notice(f"nothing to do: {setup.run} already finished {ck.step} of "
                    f"{setup.args.steps} steps")
        return 0
    try:
        device = get_device(args.device, profile)
        restart = None if group is not None or trainer_kw else (lambda: _reexec(setup, args))
        trainer = Trainer(setup, device, budget=profile.compile_budget, restart=restart, sync=group, **trainer_kw)
    except BaseException:
        if setup.created:  # no device or no kernels: leave no half-started run behind
            shutil.rmtree(setup.run, ignore_errors=True)
        raise
    if main:
        _describe(setup, group)
    try:
        outcome = trainer.train()
    finally:
        trainer.close()
    if not main:
        return 0
    text = sample_text((sample_from or (lambda s: s))(setup), setup.args.sample_tokens, setup.args.seed)
    if text is not None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    _notice(summary(setup, outcome))
    return 0


def _describe(setup, group) -> None:
    a, c = setup.args, setup.model_config
    n = sum(int(p.size) for p in (setup.frozen or setup.params).values())
    if setup.frozen is not None:
        _notice(f"LoRA: {sum(int(p.size) for p in setup.params.values()):,} trainable adapter parameters "
                f"on a frozen base")
    start = f"resuming at step {setup.checkpoint.step}" if setup.checkpoint else "from step 0"
    ranks = f" on each of {group.world} ranks" if group is not None else ""
    _notice(f"run {setup.run}: {c.model_type} {n / 1e6:.2f}M parameters, {a.steps} steps of "
            f"{a.batch_size}x{a.seq_len} tokens{ranks} (x{a.grad_accum} accum), {a.pipeline} pipeline, {start}")
    _notice(f"data: {setup.data.source}, {setup.data.describe()}, vocab {c.vocab_size}")


def _reexec(setup, args: argparse.Namespace) -> None:
    """Replace this process by `anelm train ... --resume` (same settings, device, profile)."""
    argv = [sys.executable, "-m", "anelm", "train", *setup.settings.argv(),
            f"--out={setup.run}", "--resume", f"--device={args.device}"]
    if args.profile:
        spec = os.path.abspath(args.profile) if os.path.exists(args.profile) else args.profile
        argv.append(f"--profile={spec}")
        os.environ["ANELM_PROFILE"] = spec  # a profile survives the restart: the env var carries it too
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _notice(msg: str) -> None:
    print(f"anelm: {msg}", file=sys.stderr, flush=True)
