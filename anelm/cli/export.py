"""`anelm export RUN --out DIR`: write a training run, or a GGUF file, as a Hugging Face folder
(config.json, model.safetensors, tokenizer files) that `transformers` loads."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run folder (its latest checkpoint), one checkpoint file, or a .gguf file")
    p.add_argument("--out", required=True, metavar="DIR", help="new folder for the HF model")


def run(args: argparse.Namespace) -> int:
    from ..train.export import export_run

    out, step = export_run(args.run, args.out)
    what = f"{args.run} (step {step})" if step is not None else args.run
    print(f"anelm: exported {what} to {out}", file=sys.stderr)
    return 0
