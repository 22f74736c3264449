"""The training step of each layer family (`kernels/families`), full and LoRA: the one place
the trainer learns which CPU half goes with an architecture's device kernels."""

from __future__ import annotations

from functools import cache

from ...kernels.families import family_for
from .lora import GemmaLoraTrainStep, GPT2LoraTrainStep, LoraTrainStep
from .llama import DeviceTrainStep
from .gemma import GemmaTrainStep
from .gpt2 import GPT2TrainStep


def step_class(config, lora: bool = False) -> type:
    """The step class for `config`'s family: the full step, or with `lora` its LoRA step."""
    steps = {"llama": (DeviceTrainStep, LoraTrainStep), "gpt2": (GPT2TrainStep, GPT2LoraTrainStep),
             "gemma": (GemmaTrainStep, GemmaLoraTrainStep)}
    return _at_length(steps[family_for(config.model_type).name][int(lora)])


@cache
def _at_length(cls: type) -> type:
    """`cls` run with the config of its sequence, `seq_len` positions: LongRoPE's factors are
    HF's for a forward pass of that length (`models/rope.py`; the config itself elsewhere)."""
    class Step(cls):
        def __init__(self, config, *args, seq_len: int, **kw):
            super().__init__(getattr(config, "at_length", lambda n: config)(seq_len), *args, seq_len=seq_len, **kw)

    Step.__name__ = Step.__qualname__ = cls.__name__
    return Step


def lora_train_step(config, weights, device, **kw) -> LoraTrainStep:
    """The LoRA step for the base's architecture (keywords as `steps.lora.LoraHooks`)."""
    return step_class(config, lora=True)(config, weights, device, **kw)
