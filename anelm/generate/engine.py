"""A model ready to generate: loaded, its runner started, its prompts encoded (`Engine`).

A server loads once with `load_engine`. `anelm generate`, `chat` and `perplexity` take the two
steps themselves (`load_parts`, then `start_runner`): what the runner should serve (a prompt's
length, a window) is known only once the tokenizer is.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:  # numpy and the models load with the model, not with `anelm --help`
    from .generate import Delta
    from .runner import Runner
    from .sampling import SamplingOptions


def notice(msg: str) -> None:
    print(f"anelm: {msg}", file=sys.stderr, flush=True)


def load_parts(model: str | Path, tokenizer: str | Path | None = None) -> tuple[Any, Any, Any]:
    """(config, weights, tokenizer) of a model path (docs/models.md); `tokenizer` overrides the model's."""
    from ..models.errors import TokenizerError
    from ..models.loading import load_model

    # Loading makes ~130k long-lived objects (tokenizer tables, the GGUF reader's parts, numba's
    # dispatchers) and the collector's full passes over them cost 60-120 ms each here: none of
    # them is garbage, so the collector waits until loading is done (`start_runner` freezes them).
    collecting = gc.isenabled()
    gc.disable()
    try:
        config, weights, tok = load_model(model, tokenizer)
    finally:
        if collecting:
            gc.enable()
    if tok is None:
        raise TokenizerError(f"no tokenizer found for {model}: pass --tokenizer PATH")
    return config, weights, tok


def start_runner(model: str | Path, config: Any, weights: Any, *, adapter: str | Path | None = None,
                 device: str = "auto", profile: str | Path | None = None, max_context: int | None = None,
                 notice: Callable[[str], None] = notice) -> Runner:
    """The runner for `device` and the chip `profile` (None: ANELM_PROFILE, else strict), with
    the LoRA `adapter` folder when given; the notices say what was chosen. `max_context` caps
    the positions it serves (fewer, better-fitting program sizes). The runner takes `weights`:
    each layer's float32 matrices go once converted (peak memory)."""
    from ..chip.profile import load_profile
    from .runner import make_runner

    chip = load_profile(profile)  # a bad path fails here, even when the CPU path ignores it
    lora = load_adapter(model, adapter, config)
    n = sum(int(w.size) for w in weights.values())
    runner = make_runner(config, weights, device, max_context, profile=chip, adapter=lora, consume=True)
    # What loading and the runner built lives as long as the process: moved out of the
    # collector's reach, a full collection during prefill or decode walks only what they make.
    gc.freeze()
    notice(f"model: {config.model_type}, {n / 1e6:.2f}M parameters, context {config.max_position_embeddings}")
    if lora is not None:
        notice(f"adapter: {adapter}, LoRA rank {lora.rank} on {', '.join(lora.spec.targets)}")
    if runner.device == "cpu":  # get_device announced the device itself otherwise
        notice(f"device: cpu (numpy reference; no device pipeline in this build for --device {device})")
    return runner


def load_adapter(model: str | Path, adapter: str | Path | None, config: Any) -> Any:
    """The LoRA adapter in folder `adapter`, checked against the base (None without one)."""
    if adapter is None:
        return None
    from ..models.formats.peft import load_peft
    from ..models.formats.quantized import refuse_quantized

    refuse_quantized(model, "--adapter")
    return load_peft(adapter, config)


# generation_config.json's keys that are sampling defaults, under their SamplingOptions names
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str | Path) -> SamplingOptions:
    """OpenAI's defaults under those of the model folder's generation_config.json, if it has one
    (a GGUF file has none). Its `do_sample: false` is greedy, as in HF."""
    from ..models.errors import LoadError
    from .sampling import SamplingError, SamplingOptions

    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return SamplingOptions()
    try:
        gen = json.loads(path.read_text(encoding="utf-8"))
        found = {ours: gen[theirs] for theirs, ours in GENERATION_KEYS.items() if gen.get(theirs) is not None}
        if gen.get("do_sample") is False:
            found["temperature"] = 0.0
        return SamplingOptions(**found).check()
    except (OSError, ValueError, AttributeError, SamplingError) as e:
        raise LoadError(f"{path}: expected a JSON object of HF generation settings ({e})") from None


def completion_ids(tok: Any, text: str) -> list[int]:
    """The prompt ids of a plain text, as `anelm generate --prompt` encodes it: the tokenizer's
    own, with its post-processor deciding any BOS; an empty text starts from BOS (GPT-2's is
    <|endoftext|>). [] when the text is empty and there is no BOS."""
    ids = tok.encode(text)
    return [tok.bos_id] if not ids and tok.bos_id is not None else ids


@dataclass
class Engine:
    """A model with its runner started: what a server answers requests with."""

    config: Any  # the model's (anelm.models.config), HF field names
    tokenizer: Any
    runner: Runner
    model_id: str  # the name requests use
    defaults: SamplingOptions  # `generation_defaults`: what a request does not set
    context: int  # the positions a cache holds: the model's context, or fewer under max_context

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt ids of a conversation: its chat template, ready for the assistant's turn."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)

    def completion_prompt(self, text: str) -> list[int]:
        from ..models.errors import InputError

        ids = completion_ids(self.tokenizer, text)
        if not ids:
            raise InputError("the prompt is empty and the tokenizer has no BOS token: expected some text")
        return ids

    def options(self, **overrides: Any) -> SamplingOptions:
        """The defaults with a request's values over them, checked (SamplingError)."""
        return replace(self.defaults, **overrides).check(getattr(self.config, "vocab_size", None))

    def constraint(self, response_format: dict | None) -> Any:
        """The logits processor that keeps the output to OpenAI's `response_format` (None for
        text), ending where the model's EOS ids may (`anelm.generate.constrain`)."""
        from .constrain import response_constraint

        return response_constraint(self.tokenizer, response_format, eos_ids=self.config.eos_ids)

    def stream(self, prompt_ids: Sequence[int], options: SamplingOptions, **kw: Any) -> Iterator[Delta]:
        """`stream_generate` on this engine's runner and tokenizer."""
        from .generate import stream_generate

        return stream_generate(self.runner, self.tokenizer, prompt_ids, options, **kw)


def load_engine(model: str | Path, *, tokenizer: str | Path | None = None, adapter: str | Path | None = None,
                device: str = "auto", profile: str | Path | None = None, max_context: int | None = None,
                model_id: str | None = None, notice: Callable[[str], None] = notice) -> Engine:
    """Load `model` (docs/models.md) and start its runner; `model_id` defaults to the model
    file's or folder's base name (docs/serving.md)."""
    defaults = generation_defaults(model)  # a broken file fails before the model loads
    config, weights, tok = load_parts(model, tokenizer)
    runner = start_runner(model, config, weights, adapter=adapter, device=device, profile=profile,
                          max_context=max_context, notice=notice)
    context = runner.new_cache().capacity  # caches grow as they fill: an empty one costs nothing
    return Engine(config, tok, runner, model_id or Path(os.path.abspath(model)).name, defaults, context)
