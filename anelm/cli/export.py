"""`anelm export RUN --out DIR`: write a training run, or a GGUF file, as a Hugging Face folder
(config.json, model.safetensors, tokenizer files) that `transformers` loads; a finetune RUN as
its PEFT adapter folder, or with --merge as the HF folder of the base with the adapter folded in."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run folder (its latest checkpoint), one checkpoint file, or a .gguf file")
    p.add_argument("--out", required=True, metavar="DIR", help="new folder for the HF model")
    p.add_argument("--merge", action="store_true",
                   help="finetune RUN: write the base with the adapter folded in (default: the PEFT adapter folder)")
    p.add_argument("--base", metavar="PATH", default=None,
                   help="finetune RUN: the base model, when it is no longer where the adapter says")


def run(args: argparse.Namespace) -> int:
    from ..train.export import export_run

    out, step = export_run(args.run, args.out, merge=args.merge, base=args.base)
    what = f"{args.run} (step {step})" if step is not None else args.run
    print(f"anelm: exported {what} to {out}", file=sys.stderr)
    return 0
