"""`anelm perplexity`: teacher-forced perplexity of a text file under a model (docs/models.md).

Without `--json` it prints `perplexity P (nll X nats over N predictions)`; with `--json`, one
JSON line with the evaluated ids and every window's argmax choices, which is what a comparison
against another implementation (HF transformers, a quantized or fine-tuned model) needs.

A `.jsonl` file is instruction data (docs/fine-tuning.md): each record is scored on its own and only
its counted tokens (the answer, the completion; all of them with --train-on-prompt) add; `--json`
adds `"records"`, one `{"line", "tokens", "predictions", "nll"}` per record.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import add_adapter_arg, add_device_args, positive_int
from .generate import load, start

DEFAULT_WINDOW = 512


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH",
                   help="an HF folder, a .gguf file, a llama2.c .bin or a RUN folder")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer file or folder (default: the model's)")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="UTF-8 text to score, or a .jsonl file of messages, prompt/completion or text records")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="N",
                   help=f"tokens per window, each scored from an empty cache "
                        f"(default: the smaller of the context and {DEFAULT_WINDOW})")
    p.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                   help="score only the first N tokens of the file (default: all)")
    p.add_argument("--train-on-prompt", action="store_true",
                   help="for .jsonl data: score every token, not only the answers and completions")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_adapter_arg(p)
    add_device_args(p)


def read_text(path: str) -> str:
    from ..models.errors import InputError

    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"data file not found: {p}: expected a UTF-8 text file") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{p} is not UTF-8 text (byte {e.start}): expected a UTF-8 text file") from None
    except IsADirectoryError:
        raise InputError(f"{p} is a folder: expected a UTF-8 text file") from None


def run(args: argparse.Namespace) -> int:
    from ..generate.perplexity import perplexity, windows
    from ..models.errors import InputError

    if Path(args.data).suffix.lower() == ".jsonl":
        return run_jsonl(args)
    text = read_text(args.data)  # before the model loads: a wrong path fails fast
    if not text:
        raise InputError(f"data file {args.data} is empty: expected UTF-8 text to score")
    if args.seq_len is not None:
        windows([], args.seq_len)  # its --seq-len check, also before the model loads
    config, weights, tok = load(args)
    seq = window(args, config)
    ids = tok.encode(text)[:args.max_tokens]
    runner = start(args, config, weights, max_context=seq)
    report(args, perplexity(runner, ids, seq), runner)
    return 0


def run_jsonl(args: argparse.Namespace) -> int:
    from ..generate.perplexity import score_records, windows
    from ..train.data.instruct import encode_records, read_records

    path = Path(args.data)
    shape, records = read_records(path)  # every line checked before the model loads
    if args.seq_len is not None:
        windows([], args.seq_len)
    config, weights, tok = load(args)
    seq = window(args, config)
    examples = encode_records(path, shape, records, tok, args.train_on_prompt)
    items, left = [], args.max_tokens
    for e in examples:  # --max-tokens: the first N tokens of the records, one after another
        if left is not None and left <= 0:
            break
        items.append((e.line, e.ids[:left], e.counted[:left]))
        left = None if left is None else left - len(e.ids)
    runner = start(args, config, weights, max_context=seq)
    report(args, score_records(runner, items, seq), runner)
    return 0


def window(args: argparse.Namespace, config) -> int:
    from ..models.errors import InputError

    context = config.max_position_embeddings
    seq = args.seq_len or min(context, DEFAULT_WINDOW)
    if seq > context:
        raise InputError(f"--seq-len {seq} exceeds the model's context of {context}")
    return seq


def report(args: argparse.Namespace, score, runner) -> None:
    if args.json:
        out = {"tokens": score.tokens, "windows": score.windows, "predictions": score.predictions,
               "nll": score.nll, "ppl": score.ppl, "argmax": score.argmax, "device": runner.device,
               "stream_scale": getattr(runner, "stream_scale", 1.0)}
        if score.records is not None:
            out["records"] = [{"line": r.line, "tokens": r.tokens, "predictions": r.predictions, "nll": r.nll}
                              for r in score.records]
        print(json.dumps(out))
    else:
        print(f"perplexity {score.ppl:.4f} (nll {score.nll:.4f} nats over {score.predictions} predictions)")
