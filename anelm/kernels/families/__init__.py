"""One module per architecture family: how its layers differ from the layer library's common
path (`kernels/layers.py`, `lora.py`, `int8.py`, `training.py`), which asks the family
(`LayerShape.family`) and never the model type.

A `Family` (`base.py`) says which norm (LayerNorm or RMSNorm) and MLP graph a layer has,
whether positions are rotary, its attention scale and eps, where its parameters are (by role,
through `anelm.models.names`), which projections read each norm and write the stream, its
LoRA slots (the kernel projections and the roles in their rows, which `int8.py` quantizes
too) and the training kernels' weight blocks. Adding an architecture: a `models/<model_type>.py`
with its names, and a family module here or membership of one (`models.names.FAMILY`: Qwen3 is a Llama).
"""

from __future__ import annotations

from ...models.names import family
from .base import Family
from .gemma import FAMILY as GEMMA
from .gpt2 import FAMILY as GPT2
from .llama import FAMILY as LLAMA

FAMILIES = {f.name: f for f in (GPT2, LLAMA, GEMMA)}


def family_for(model_type: str) -> Family:
    """The family of a model type (its layer layout in `models.names.FAMILY`)."""
    return FAMILIES[family(model_type)]
