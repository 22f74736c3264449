"""`anelm quantize --model PATH --out DIR [--scheme w8|w8a8|w4|lut4|lut6] [--block-size N]
[--group-size N] [--data FILE] [--calib-tokens 4096]` (docs/quantization.md): int8 weights per output
channel (W8), or also int8 activations at static per-tensor scales calibrated on --data (W8A8),
or 4-bit weights in blocks along the inputs with fp16 scales and offsets (W4; a GGUF's own
Q4_0/Q4_1 blocks at block size 32), or palettized weights, 4- or 6-bit indices into k-means
fp16 tables of --group-size rows by up to --block-size inputs (LUT4/LUT6). Prints the report on
stderr (with --json, the report as one line on stdout) and writes it to
DIR/quantization_report.json."""

from __future__ import annotations

import argparse
import json

from .common import add_device_args, positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="an HF folder, a .gguf file, a llama2.c .bin or a RUN folder (not a quantized folder)")
    p.add_argument("--out", required=True, metavar="DIR", help="new folder for the quantized model")
    p.add_argument("--scheme", choices=["w8", "w8a8", "w4", "lut4", "lut6"], default="w8",
                   help="w8: int8 weights (default); w8a8: int8 weights and activations; w4: 4-bit weight blocks; "
                        "lut4/lut6: 4-/6-bit indices into fp16 lookup tables")
    p.add_argument("--block-size", type=positive_int, default=None, metavar="N",
                   help="w4: inputs per block of one scale and offset (default 32, GGUF Q4_0/Q4_1's); lut4/lut6: "
                        "at most N inputs share a table (default 192 for lut4, a whole row for lut6)")
    p.add_argument("--group-size", type=positive_int, default=None, metavar="N",
                   help="lut4/lut6: rows sharing a table (default 1 for lut4, 16 for lut6)")
    p.add_argument("--data", metavar="FILE",
                   help="UTF-8 text: calibration first, then held-out scoring (required for w8a8; "
                        "w8 defaults to the built-in stories)")
    p.add_argument("--calib-tokens", type=positive_int, default=4096, metavar="N",
                   help="tokens of --data that calibrate (default 4096)")
    p.add_argument("--eval-tokens", type=positive_int, default=512, metavar="N",
                   help="held-out tokens after them that both models are scored on (default 512)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line on stdout")
    add_device_args(p)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..quant.command import print_summary, quantize_command
    from .perplexity import read_text

    if args.group_size is not None and not args.scheme.startswith("lut"):
        raise UsageError(f"quantize: --group-size applies to --scheme lut4 or lut6, not {args.scheme}")
    if args.scheme == "w8a8" and not args.data:
        raise UsageError("quantize: --scheme w8a8 needs --data FILE to calibrate the activation scales")
    if args.data:
        text = read_text(args.data)
    else:
        from ..train.data.corpus import generate_corpus

        text = generate_corpus(60_000)
    from ..chip.profile import load_profile

    profile = load_profile(args.profile)  # a bad path fails before any work
    report = quantize_command(args.model, args.out, args.scheme, text, args.calib_tokens, args.eval_tokens,
                              args.device, profile=profile, block_size=args.block_size, group_size=args.group_size)
    print_summary(report)
    if args.json:
        print(json.dumps(report))
    return 0
