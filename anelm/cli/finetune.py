"""`anelm finetune`: LoRA on a frozen base, forward and dx on the device, adapters on the CPU.

    anelm finetune --model smollm2.gguf --data notes.txt --steps 60 --out runs/notes
    anelm finetune --model ~/models/Qwen3-0.6B --data notes.txt --rank 16 --targets all-linear --dropout 0.05
    anelm finetune --out runs/notes --resume        # continue (killed or finished)
    anelm generate --model smollm2.gguf --adapter runs/notes/adapter --prompt "..."

The run folder is a train run (docs/training.md) plus RUN/adapter/ in PEFT's layout
(docs/fine-tuning.md), written with each checkpoint; checkpoints hold the adapters and their
optimizer state, not the base.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from .common import (add_device_args, add_distributed_args, add_run_folder_args, check_before_loading,
                     positive_int)
from .train import _number, _train, add_settings_args

# flags of `anelm train` that name or build another model than --model's
NOT_FOR_FINETUNE = ("preset", "init_from", "bpe_vocab_size")


def add_args(p: argparse.ArgumentParser) -> None:
    from ..train.lora import FINETUNE_DEFAULTS

    p.add_argument("--model", dest="init_from", default=None, metavar="PATH",
                   help="the base: an HF folder, a RUN folder or a .gguf file (not a quantized folder)")
    p.add_argument("--rank", type=positive_int, default=None, metavar="N", help="LoRA rank r (default: 8)")
    p.add_argument("--alpha", type=lambda t: _number(t, True), default=None, metavar="X",
                   help="LoRA alpha; the adapter term is scaled by alpha / r (default: 16)")
    p.add_argument("--dropout", type=_probability, default=None, metavar="P",
                   help="LoRA dropout on the adapters' inputs in training, as PEFT's lora_dropout "
                        "(default: 0); eval loss runs without it")
    p.add_argument("--targets", default=None, metavar="LIST",
                   help="comma-separated HF module names (q_proj,v_proj for Llama/Qwen3, c_attn for "
                        "GPT-2: the defaults), or all-linear")
    add_settings_args(p, skip=NOT_FOR_FINETUNE, defaults=FINETUNE_DEFAULTS)
    add_run_folder_args(p)
    add_device_args(p)
    add_distributed_args(p)


def _probability(text: str) -> float:
    """--dropout: p in [0, 1) (p = 1 would drop every input the adapters see)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 <= v < 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got '{text}'")
    return v


def run(args: argparse.Namespace) -> int:
    from ..chip.profile import load_profile
    from ..errors import UsageError
    from ..train.lora import adapter_writer, best_writer, merged_setup, prepare_finetune, step_factory
    from ..train.settings import TrainSettings

    if args.resume and not args.out:
        raise UsageError("--resume needs --out RUN: the run folder to continue")
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    profile = load_profile(args.profile)  # a bad profile fails before any work
    check_before_loading(args)  # and --device ane off a Mac, before a model or the data load
    explicit = {n: getattr(args, n, None) for n in TrainSettings.names()}
    lora = {k: getattr(args, k) for k in ("rank", "alpha", "dropout", "targets")}

    def make():
        setup = prepare_finetune(explicit, lora, out, args.resume)
        try:
            _check_static_budget(setup, profile)
        except UsageError:
            if setup.created:
                shutil.rmtree(setup.run, ignore_errors=True)
            raise
        return setup

    def go(setup, group):
        return _train(args, profile, setup, group, sample_from=merged_setup,
                      step_factory=step_factory(setup), after_save=adapter_writer(setup),
                      write_best=best_writer(setup))

    if not args.distributed:
        return go(make(), None)
    from ..train.distributed.setup import share_setup
    from ..train.distributed import join

    group = join(args.dist_timeout)
    try:
        return go(share_setup(group, make), group)
    finally:
        group.close()


def _check_static_budget(setup, profile) -> None:
    """LoRA's static kernels compile once, 8 per layer: refuse a base that cannot fit them."""
    from ..errors import UsageError
    from ..kernels.training import WEIGHTED, WEIGHTLESS

    need = len(WEIGHTED) * setup.model_config.num_hidden_layers + len(WEIGHTLESS)
    if setup.args.pipeline == "static" and profile.compile_budget and need > profile.compile_budget:
        raise UsageError(f"--pipeline static bakes {len(WEIGHTED)} kernels per layer: {need} compiles for "
                         f"{setup.model_config.num_hidden_layers} layers exceed the compile budget of "
                         f"{profile.compile_budget}; expected --pipeline dynamic")
