"""The architectures anelm runs, each one module of `anelm.models` named by its HF `model_type`.

A module declares what its architecture is: `Config`, the CPU reference `Model`,
`expected_shapes`, `sanitize`/`unsanitize` (HF checkpoint <-> ours), `GGUF_ARCH` (llama.cpp's
`general.architecture`), and where they differ from Llama's, `gguf_config` (its metadata) and
`gguf_weights` (what llama.cpp's converter changed). Code that needs an architecture asks here
or `loading.architecture`, never branches on a model type.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

MODEL_TYPES = ("gpt2", "llama", "qwen3", "gemma3_text")


@cache
def module(model_type: str) -> ModuleType:
    return importlib.import_module(f"anelm.models.{model_type}")


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` names anelm reads."""
    return tuple(module(t).GGUF_ARCH for t in MODEL_TYPES)


def model_type_of_gguf(arch: object) -> str | None:
    """The model type of a GGUF `general.architecture` name, or None when anelm has none."""
    return next((t for t in MODEL_TYPES if module(t).GGUF_ARCH == arch), None)
