"""The training step of each layer family (`kernels/families`), full and LoRA: the one place
the trainer learns which CPU half goes with an architecture's device kernels."""

from __future__ import annotations

from ..kernels.families import family_for


def step_class(config, lora: bool = False) -> type:
    """The step class for `config`'s family: the full step, or with `lora` its LoRA step."""
    from .lora_step import GemmaLoraTrainStep, GPT2LoraTrainStep, LoraTrainStep
    from .step import DeviceTrainStep
    from .step_gemma import GemmaTrainStep
    from .step_gpt2 import GPT2TrainStep

    steps = {"llama": (DeviceTrainStep, LoraTrainStep), "gpt2": (GPT2TrainStep, GPT2LoraTrainStep),
             "gemma": (GemmaTrainStep, GemmaLoraTrainStep)}
    return steps[family_for(config.model_type).name][int(lora)]
