"""`anelm bench`: predict the ANE from the compiled programs, and measure the device beside it.

    anelm bench validate                       # every published figure, the prediction, the error
    anelm bench train --preset stories110m --pipeline dynamic --json
    anelm bench kernels --preset stories110m --png roofline.png
    anelm bench sram --png sram.png            # matmul time against working set, per chip
    anelm bench peak | generate --preset P     # conv-chain peaks; prefill and decode
    anelm bench --chips                        # the chips the data file has constants for

`--baseline FILE` compares every `_ms` (lower is better) and `_per_s` (higher is better) figure
with a saved run and exits 1 naming each that got worse than its threshold (anelm/bench/baseline.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from .common import positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    from ..bench.commands import BENCHMARKS

    p.add_argument("what", nargs="?", choices=list(BENCHMARKS), help="the benchmark to run")
    p.add_argument("--chip", default=None, help="chip to predict (default: m4 off a Mac; see --chips)")
    p.add_argument("--chips", action="store_true", help="list the chips with constants and exit")
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    p.add_argument("--save-baseline", default=None, metavar="FILE", help="write the printed JSON object to FILE")
    p.add_argument("--baseline", default=None, metavar="FILE",
                   help="compare with FILE; exit 1 naming each figure that got worse than its threshold")
    p.add_argument("--png", default=None, metavar="FILE", help="sram: time against working set; kernels: roofline")
    p.add_argument("--preset", default=None, help="train/kernels/generate: model preset (default: tiny)")
    p.add_argument("--model", default=None, metavar="PATH", help="generate: a model the loader reads (HF folder, .gguf, .bin, checkpoint, RUN)")
    p.add_argument("--pipeline", choices=["dynamic", "static"], default="dynamic",
                   help="train: weights as kernel inputs (dynamic) or baked and recompiled (static)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="N",
                   help="train/kernels: tokens per sequence (default: the preset's)")
    p.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                   help="train/kernels: sequences per micro-batch (default: the preset's)")
    p.add_argument("--grad-accum", type=positive_int, default=None, metavar="N",
                   help="train: micro-batches per optimizer step (default: 1)")
    p.add_argument("--head-on", choices=["auto", "ane", "cpu", "gpu"], default="auto",
                   help="train: where the classifier and its loss run (auto: the one predicted fastest on the chip)")
    p.add_argument("--embed-on", choices=["cpu", "gpu"], default="cpu",
                   help="train: where the embedding's gather and its gradient run")
    p.add_argument("--repeat", type=positive_int, default=5, metavar="N",
                   help="timed runs per measurement, the best of them is reported (default: 5)")
    p.add_argument("--no-measure", action="store_true", help="predict only; run nothing on the device")


def run(args: argparse.Namespace) -> int:
    from ..bench import baseline
    from ..chip.catalog import chip_names, get_chip
    from ..bench.commands import BENCHMARKS, chips_table
    from ..errors import UsageError

    if args.chips:
        result, lines = chips_table()
    elif args.what is None:
        raise UsageError("bench: expected a benchmark (peak, sram, kernels, train, generate, validate) or --chips")
    else:
        chip = get_chip(args.chip).key  # an unknown chip fails before any work
        if args.png and args.what not in ("sram", "kernels"):
            raise UsageError(f"--png: only sram and kernels draw a PNG, not {args.what}")
        result, lines, png = BENCHMARKS[args.what](
            chip=chip, chips=[chip] if args.chip else chip_names(), preset=args.preset, model=args.model,
            pipeline=args.pipeline, measure=not args.no_measure, repeat=args.repeat, seq_len=args.seq_len,
            batch_size=args.batch_size, grad_accum=args.grad_accum, head_on=args.head_on,
            embed_on=args.embed_on)
        if args.png:
            png(args.png)
            print(f"anelm: wrote {args.png}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(lines))
    if args.save_baseline:
        baseline.save(result, args.save_baseline)
    if args.baseline:
        worse = baseline.regressions(result, baseline.load(args.baseline))
        for line in worse:
            print(f"anelm: regression: {line}", file=sys.stderr)
        return 1 if worse else 0
    return 0
