"""`anelm generate`: text from an HF folder, a llama2.c `.bin` or a RUN folder (CONTRACTS §5).

Tokens stream to stdout as they are produced; with `--json`, stdout is one JSON line instead.
Notices (model, device, speed) go to stderr.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
from typing import Any

from .common import add_adapter_arg, add_device_args, adapter_from_args, check_before_loading, utf8_text


def notice(msg: str) -> None:
    print(f"anelm: {msg}", file=sys.stderr, flush=True)


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
    from ..models.errors import TokenizerError
    from ..models.loading import load_model

    # a build without the device pipeline runs on the CPU, whatever --device says (`start`)
    pipeline = "anelm.generate.pipeline"
    has = sys.modules[pipeline] is not None if pipeline in sys.modules else importlib.util.find_spec(pipeline)
    check_before_loading(args, device=bool(has))
    # Loading makes ~130k long-lived objects (tokenizer tables, the GGUF reader's parts, numba's
    # dispatchers) and the collector's full passes over them cost 60-120 ms each here: none of
    # them is garbage, so the collector waits until loading is done (`start` then freezes them).
    collecting = gc.isenabled()
    gc.disable()
    try:
        config, weights, tok = load_model(args.model, args.tokenizer)
    finally:
        if collecting:
            gc.enable()
    if tok is None:
        raise TokenizerError(f"no tokenizer found for {args.model}: pass --tokenizer PATH")
    return config, weights, tok


def start(args: argparse.Namespace, config: Any, weights: Any, max_context: int | None = None) -> Any:
    """The runner for --device / --profile (and --adapter), with the notices saying what was
    chosen; `max_context` caps the positions it serves (fewer, better-fitting program sizes)."""
    from ..chip.profile import load_profile
    from ..generate.runner import make_runner

    profile = load_profile(args.profile)  # a bad path fails here, even when the CPU path ignores it
    adapter = adapter_from_args(args, config)
    n = sum(int(w.size) for w in weights.values())
    # the runner takes the weights: each layer's float32 matrices go once converted (peak memory)
    runner = make_runner(config, weights, args.device, max_context, profile=profile, adapter=adapter, consume=True)
    # What loading and the runner built lives as long as the process: moved out of the
    # collector's reach, a full collection during prefill or decode walks only what they make.
    gc.freeze()
    notice(f"model: {config.model_type}, {n / 1e6:.2f}M parameters, context {config.max_position_embeddings}")
    if adapter is not None:
        notice(f"adapter: {args.adapter}, LoRA rank {adapter.rank} on {', '.join(adapter.spec.targets)}")
    if runner.device == "cpu":  # get_device announced the device itself otherwise
        notice(f"device: cpu (numpy reference; no device pipeline in this build for --device {args.device})")
    return runner


def stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from ..generate.device_plan import generation_context
    from ..generate.generate import check_prompt, generate
    from ..models.errors import InputError

    opts = sampling(args)
    config, weights, tok = load(args)
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids and tok.bos_id is not None:
        prompt_ids = [tok.bos_id]  # an empty prompt starts from BOS (GPT-2: <|endoftext|>)
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
