"""`anelm generate`: text from an HF folder, a llama2.c `.bin` or a RUN folder (docs/models.md).

Tokens stream to stdout as they are produced; with `--json`, stdout is one JSON line instead.
Notices (model, device, speed) go to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from ..generate.engine import load_parts, notice, start_runner
from .common import add_adapter_arg, add_device_args, check_before_loading, utf8_text


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags `generate` and `chat` share."""
    p.add_argument("--model", required=True, metavar="PATH",
                   help="an HF folder, a RUN folder, a llama2.c .bin (tokenizer.bin beside it) or a .gguf file")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer file or folder (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalty for seen tokens (default 1.0: off)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", type=utf8_text,
                   help="stop at this text (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_adapter_arg(p)
    add_device_args(p)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompt", default="", type=utf8_text, help="text to continue (default: empty, start from BOS)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of streaming")


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """Sampler and logit processors from the flags; bad values fail before the model loads."""
    from ..generate.sampling import check_sampling, make_logits_processors, make_sampler

    check_sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.max_tokens)
    return dict(sampler=make_sampler(args.temperature, args.top_k, args.top_p, args.seed),
                logits_processors=make_logits_processors(args.repetition_penalty),
                max_tokens=args.max_tokens, stop=list(args.stop))


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(config, weights, tokenizer) for --model / --tokenizer."""
    # a build without the device pipeline runs on the CPU, whatever --device says (`start`)
    pipeline = "anelm.generate.pipeline"
    has = sys.modules[pipeline] is not None if pipeline in sys.modules else importlib.util.find_spec(pipeline)
    check_before_loading(args, device=bool(has))
    return load_parts(args.model, args.tokenizer)


def start(args: argparse.Namespace, config: Any, weights: Any, max_context: int | None = None) -> Any:
    """The runner for --device / --profile (and --adapter), with the notices saying what was
    chosen; `max_context` caps the positions it serves (fewer, better-fitting program sizes)."""
    return start_runner(args.model, config, weights, adapter=getattr(args, "adapter", None), device=args.device,
                        profile=args.profile, max_context=max_context)


def stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from ..generate.device_plan import generation_context
    from ..generate.engine import completion_ids
    from ..generate.generate import check_prompt, generate
    from ..models.errors import InputError

    opts = sampling(args)
    config, weights, tok = load(args)
    prompt_ids = completion_ids(tok, args.prompt)
    if not prompt_ids:
        raise InputError("the prompt is empty and the tokenizer has no BOS token: pass --prompt")
    check_prompt(len(prompt_ids), config.max_position_embeddings)  # before any device work
    # one generation never holds more than its prompt and its new tokens: programs sized to that
    runner = start(args, config, weights, max_context=generation_context(len(prompt_ids) + args.max_tokens))
    del weights  # the runner keeps what it needs (a device runner: fp16 copies, not the float32 layers)
    res = generate(runner, tok, prompt_ids, on_text=None if args.json else stream, **opts)
    if args.json:
        print(json.dumps({"prompt_ids": res.prompt_ids, "ids": res.ids, "text": res.text,
                          "prefill_ms": round(res.prefill_ms, 3),
                          "decode_tokens_per_s": round(res.decode_tokens_per_s, 3), "device": runner.device,
                          "stream_scale": getattr(runner, "stream_scale", 1.0)},
                         ensure_ascii=False))
    else:
        stream("\n")
        notice(f"prefill {res.prefill_ms:.1f} ms, decode {res.decode_tokens_per_s:.1f} tokens/s, "
               f"{len(res.ids)} tokens ({res.finish_reason})")
    return 0
