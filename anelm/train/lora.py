"""A LoRA fine-tuning run (`anelm finetune`): a train run (docs/training.md) whose trained tensors are
adapters.

    setup = prepare_finetune(explicit, lora, out, resume)   # explicit: TrainSettings flags
    trainer = Trainer(setup, device, step_factory=step_factory(setup), after_save=adapter_writer(setup))

The run folder is `anelm train`'s, so the trainer loop, metrics, loss.png, checkpoints and
exact resume are its own (`loop.Trainer`); what differs:
- config.json carries `"anelm_finetune": {"rank", "alpha", "dropout", "targets", "base"}`
  beside the training settings, whose `init_from` is the base (`--model`; `base` is its
  absolute path, PEFT's `base_model_name_or_path`);
- the parameters are the adapter tensors (`steps.lora` names), initialized as PEFT does
  (`models.adapters.init_adapter`: A Kaiming-uniform, B zero, so step 0 is the base), and a
  checkpoint holds them and their AdamW moments, not the base, which is read again from
  `--model` on resume;
- each checkpoint is followed by RUN/adapter/ in PEFT's layout (`save_peft`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..models.adapters import LoraSpec, check_spec, init_adapter, resolve_targets
from ..models.formats.peft import save_peft
from ..models.formats.quantized import refuse_quantized
from .errors import TrainError
from .init import load_pretrained
from .steps.lora import adapter_params, adapter_shapes, params_adapter
from .run import SETTINGS_KEY, RunSetup, Trains, prepare, read_json, write_json
from .steps import lora_train_step

FINETUNE_KEY = "anelm_finetune"
ADAPTER_DIR = "adapter"
# LoRA trains few parameters from a good start: a higher peak rate than full fine-tuning,
# and no weight decay on the adapters (PEFT's and HF Trainer's default)
FINETUNE_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.0}


def lora_spec(full: dict) -> LoraSpec:
    """The run's spec from its config.json."""
    f = full[FINETUNE_KEY]
    return LoraSpec(int(f["rank"]), float(f["alpha"]), float(f["dropout"]), tuple(f["targets"]),
                    base=str(f.get("base") or full.get(SETTINGS_KEY, {}).get("init_from") or ""))


def _initial_adapter(config, args, full: dict) -> dict[str, np.ndarray]:
    return adapter_params(init_adapter(config, lora_spec(full), args.seed))


ADAPTERS = Trains(lambda config, full: adapter_shapes(config, lora_spec(full)), _initial_adapter)


def prepare_finetune(explicit: dict, lora: dict, out, resume: bool) -> RunSetup:
    """The run setup (module doc). `lora`: rank, alpha, dropout, targets as typed (None: unset)."""
    model = explicit.get("init_from")
    if not resume and not model:
        raise UsageError("finetune needs --model PATH: the base model (HF folder, RUN folder or .gguf)")
    if model:
        _check_base(model)
    if resume:
        saved = read_json(Path(out).absolute() / "config.json", what="run config") or {}
        if SETTINGS_KEY in saved and FINETUNE_KEY not in saved:
            raise TrainError(f"{out} is an anelm train run, not a finetune run; expected "
                             "`anelm train --resume` for it")
        setup = prepare(explicit, out, True, trains=ADAPTERS)
        _refuse_lora_change(lora, lora_spec(setup.config))
        setup.frozen = load_pretrained(setup.args.init_from)[1]
        return setup
    for key, value in FINETUNE_DEFAULTS.items():
        if explicit.get(key) is None:
            explicit = {**explicit, key: value}
    setup = prepare(explicit, out, False, extra={FINETUNE_KEY: {}})
    try:
        targets = resolve_targets(setup.model_config, lora.get("targets"))
        spec = LoraSpec(int(lora.get("rank") or 8), float(16.0 if lora.get("alpha") is None else lora["alpha"]),
                        float(lora.get("dropout") or 0.0), targets, base=str(model))
        check_spec(setup.model_config, spec, "--rank/--targets/--dropout")
        setup.config[FINETUNE_KEY] = {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
                                      "targets": list(spec.targets), "base": str(Path(model).absolute())}
        write_json(setup.run / "config.json", setup.config)
        setup.frozen, setup.params = setup.params, adapter_params(init_adapter(setup.model_config, spec,
                                                                               setup.args.seed))
    except BaseException:
        if setup.created:
            shutil.rmtree(setup.run, ignore_errors=True)
        raise
    return setup


def _check_base(model: str) -> None:
    p = Path(model)
    if not (p.is_dir() or (p.is_file() and p.suffix == ".gguf")):
        raise UsageError(f"--model {p}: expected an HF model folder, a RUN folder or a .gguf file, got "
                         + ("a file" if p.exists() else "nothing"))
    refuse_quantized(p, "finetune")


def _refuse_lora_change(lora: dict, spec: LoraSpec) -> None:
    saved = {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout}
    for key, value in saved.items():
        if lora.get(key) is not None and float(lora[key]) != float(value):
            raise UsageError(f"--{key} {lora[key]}: this run was started with --{key} {value}; "
                             "expected the same adapter when resuming")
    if lora.get("targets") is not None:
        raise UsageError("--targets: this run's targets are fixed by its first start "
                         f"({','.join(spec.targets)}); expected no --targets when resuming")


def step_factory(setup: RunSetup):
    """The trainer's step factory: a LoRA step over the frozen base."""
    spec = lora_spec(setup.config)

    def make(config, params, device, *, seq_len: int, pipeline: str, **packed):
        return lora_train_step(config, setup.frozen, device, seq_len=seq_len, spec=spec, adapter=params,
                               pipeline=pipeline, seed=setup.args.seed, **packed)  # the dropout masks' seed

    return make


def adapter_writer(setup: RunSetup):
    """The trainer's after-save hook: RUN/adapter/ in PEFT's layout, atomically."""
    spec = lora_spec(setup.config)

    def write(step: int, params: dict) -> None:
        save_peft(params_adapter(params, spec, setup.model_config), setup.run / ADAPTER_DIR)

    return write


def best_writer(setup: RunSetup):
    """The trainer's RUN/best writer (`validation`): the adapter of the best eval, as RUN/adapter."""
    spec = lora_spec(setup.config)
    return lambda folder, step, params: save_peft(params_adapter(params, spec, setup.model_config),
                                                  folder)


def merged_setup(setup: RunSetup) -> RunSetup:
    """A copy of `setup` whose params are the base with the adapter folded in (the end sample)."""
    from dataclasses import replace

    from ..models.adapters import merge_weights

    adapter = params_adapter(setup.params, lora_spec(setup.config), setup.model_config)
    return replace(setup, params=merge_weights(setup.frozen, adapter))
