"""What anelm runs, as the README's supported-models tables: one row per architecture, read
from the registry (`registry.py`: every `MODEL_TYPES` module's `ARCH`), and one row per model
format, so the tables change when an architecture or a format does and not otherwise.

`anelm.api.supported_models()` renders both with the facts of the layers above this one
(which families the trainer steps, the training presets); tests/test_readme.py regenerates
them and compares them with README.md's text.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .formats.quantized import SCHEMES
from .registry import MODEL_TYPES, arch, module

# the names people know an architecture by (a model type missing here shows as itself)
TITLES = {"gpt2": "GPT-2", "llama": "Llama (1, 2, 3.x), SmolLM2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3 (text)",
          "qwen2": "Qwen2, Qwen2.5", "mistral": "Mistral", "smollm3": "SmolLM3",
          "phi3": "Phi-3, Phi-3.5, Phi-4-mini"}

RUN = "generate, chat, perplexity, serve"
YES = {True: "yes", False: "no"}


@dataclass(frozen=True)
class Format:
    """A model format and what each command does with it. A "no" is a refusal in the code:
    a quantized folder is refused by `quantized.refuse_quantized` (finetune, train --init-from,
    export, --adapter, quantize), a file other than a GGUF by finetune's and --init-from's
    base check (`train/lora.py`, `train/init.py`)."""

    name: str
    run: bool       # generate, chat, perplexity, serve
    adapter: bool   # --adapter (a LoRA adapter on top)
    finetune: bool  # finetune --model, train --init-from
    quantize: bool  # anelm quantize --model


def llama2c_model_type() -> str:
    """The architecture a llama2.c checkpoint loads as: the config class its reader returns."""
    from .formats import llama2c

    config_class = typing.get_args(typing.get_type_hints(llama2c.read_llama2c)["return"])[0]
    return config_class.model_type


def formats() -> list[Format]:
    return [
        Format("HF folder: `config.json` + safetensors (sharded or not), or an HF repo id", True, True, True, True),
        Format("GGUF file (any tensor type the `gguf` package dequantizes), or `owner/name:FILE.gguf`",
               True, True, True, True),
        Format(f"llama2.c `.bin` (`{llama2c_model_type()}`), `tokenizer.bin` beside it", True, True, False, True),
        Format("RUN folder of `anelm train`", True, True, True, True),
        Format(f"folder of `anelm quantize` ({', '.join(SCHEMES)})", True, False, False, False),
    ]


def gguf_name(model_type: str) -> str:
    name = f"`{arch(model_type).gguf_arch}`"
    claims = getattr(module(model_type), "gguf_claims", None)
    if not claims:
        return name
    doc = claims.__doc__.strip().rstrip(".")
    return f"{name}: {doc[0].lower()}{doc[1:]}"


def lora_targets(model_type: str) -> str:
    return ", ".join(f"`{t}`" for t in arch(model_type).default_targets)


def architecture_rows(family: Callable[[str], Any], presets: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """One row per architecture: its names, formats and what each command does with it.
    `family(model_type)`: its layer family's kernels (`kernels.families`), None where there are
    none (generate, quantize and serve need them; finetune and train need its `trains`, the
    trainer's step); `presets`: the training presets of each model type (`anelm train --preset`)."""
    rows = []
    for t in MODEL_TYPES:
        a, f = arch(t), family(t)
        trains = f is not None and f.trains
        train = "no"
        if trains:
            own = presets.get(t, ())
            train = (f"`--preset {'`, `'.join(own)}`; " if own else "") + "`--init-from`"
        rows.append([TITLES.get(t, t), ", ".join(f"`{n}`" for n in (t, *a.aliases)), gguf_name(t), YES[f is not None],
                     f"LoRA ({lora_targets(t)} by default)" if trains else "no", train, YES[f is not None]])
    return rows


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown(family: Callable[[str], Any], presets: Mapping[str, Sequence[str]]) -> str:
    """The two tables, architectures then formats, as README.md holds them."""
    archs = table(["architecture", "HF `model_type`", "GGUF `general.architecture`", RUN, "finetune", "train",
                   f"quantize ({', '.join(SCHEMES)})"], architecture_rows(family, presets))
    yes = YES
    forms = table(["format", RUN, "`--adapter`", "finetune, `train --init-from`", "quantize"],
                  [[f.name, yes[f.run], yes[f.adapter], yes[f.finetune], yes[f.quantize]] for f in formats()])
    return archs + "\n\n" + forms + "\n"
