"""LoRA adapters in PEFT's folder layout: what `peft.PeftModel.from_pretrained` loads, and what
PEFT's `save_pretrained` writes (docs/fine-tuning.md).

    DIR/adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
                                   base_model_name_or_path, task_type CAUSAL_LM, fan_in_fan_out
                                   (true for GPT-2, whose projections are Conv1D), bias "none"
    DIR/adapter_model.safetensors  base_model.model.<module path>.lora_A.weight [r, in] and
                                   .lora_B.weight [out, r], float32

A finetune RUN folder keeps its adapter in RUN/adapter/; `load_peft` accepts either folder.
PEFT writes the keys without the adapter's name; a state dict saved by hand may carry it
(`lora_A.default.weight`), which is read too. Anything LoRA adds beyond A and B (DoRA's
magnitudes, rsLoRA's scale, per-module ranks, trained biases, `modules_to_save`) is refused,
one line each, rather than silently dropped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ...atomic import atomic_dir
from ..adapters import Adapter, LoraSpec, check_fits
from ..errors import AdapterError
from ..names import target_names
from ..registry import arch
from .safetensors_io import save_safetensors

CONFIG_FILE, WEIGHTS_FILE, PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."
KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<name>[^.]+))?\.weight")
# options PEFT may set that change what the tensors mean: (key, the only value we can run)
UNSUPPORTED = (("use_dora", False), ("use_rslora", False), ("lora_bias", False), ("bias", "none"),
               ("rank_pattern", {}), ("alpha_pattern", {}), ("modules_to_save", None))


def save_peft(adapter: Adapter, folder: str | Path) -> Path:
    """Write the adapter folder atomically (built beside `folder`, then renamed into place)."""
    s = adapter.spec
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": s.rank, "lora_alpha": s.alpha,
              "lora_dropout": s.dropout, "target_modules": list(s.targets),
              "base_model_name_or_path": s.base or None, "fan_in_fan_out": arch(adapter.model_type).conv1d,
              "bias": "none", "inference_mode": True, "init_lora_weights": True, "use_dora": False,
              "use_rslora": False, "modules_to_save": None}
    tensors = {}
    for path, (a, b) in adapter.tensors.items():
        tensors[f"{PREFIX}{path}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{PREFIX}{path}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_safetensors(tmp / WEIGHTS_FILE, tensors, metadata={"format": "pt"})  # "pt": as PEFT writes
    return folder


def adapter_folder(path: str | Path) -> Path:
    """The folder holding adapter_config.json: `path` itself, or a finetune RUN's `adapter/`."""
    p = Path(path)
    if (p / "adapter" / CONFIG_FILE).is_file() and not (p / CONFIG_FILE).is_file():
        p = p / "adapter"
    if not (p / CONFIG_FILE).is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {path}: expected a PEFT LoRA folder or a finetune "
                           "RUN folder (RUN/adapter/)")
    return p


def load_peft(path: str | Path, config) -> Adapter:
    """The adapter in `path` (ours, a finetune RUN's, or PEFT's), checked against the base `config`."""
    from ..loading import read_weight_files

    folder = adapter_folder(path)
    spec = _read_spec(folder / CONFIG_FILE, config)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        found = " (found adapter_model.bin; only safetensors are read)" if (folder / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}{found}: expected the adapter's tensors beside "
                           f"{CONFIG_FILE}")
    tensors = _pairs(read_weight_files([weights]), weights, config.model_type)
    targets = {m.rsplit(".", 1)[-1] for m in tensors}
    valid = target_names(config.model_type)
    spec = LoraSpec(spec.rank, spec.alpha, spec.dropout,
                    tuple(t for t in valid if t in targets) + tuple(sorted(targets - set(valid))), spec.base)
    adapter = Adapter(spec, config.model_type, tensors)
    check_fits(adapter, config, str(folder))
    return adapter


def _read_spec(f: Path, config) -> LoraSpec:
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{f}: not valid JSON ({e}): expected a PEFT adapter config") from None
    if not isinstance(d, dict) or d.get("peft_type") != "LORA":
        got = d.get("peft_type") if isinstance(d, dict) else type(d).__name__
        raise AdapterError(f"{f}: peft_type {got!r} is not LoRA: expected peft_type \"LORA\"")
    for key, ok in UNSUPPORTED:
        v = d.get(key)
        if not (v is None or v == ok or (not v and not ok)):
            raise AdapterError(f"{f}: {key}={d[key]!r} is not supported: expected {key}={json.dumps(ok)}")
    r, alpha = d.get("r"), d.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{f}: rank r={r!r}: expected an integer r >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{f}: lora_alpha={alpha!r}: expected a number")
    listed = d.get("target_modules")
    if isinstance(listed, list):  # a regex string names modules by pattern: the tensors say which
        bad = [t for t in listed if t not in target_names(config.model_type)]
        if bad:
            raise AdapterError(f"{f}: target module {bad[0]!r}, which the {config.model_type} base lacks: "
                               f"expected target modules among {', '.join(target_names(config.model_type))}")
    return LoraSpec(r, float(alpha), float(d.get("lora_dropout") or 0.0), (), d.get("base_model_name_or_path") or "")


def _pairs(raw: dict[str, np.ndarray], source: Path, model_type: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT's keys -> {module path: (A, B)}."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    names = set()
    for key, t in raw.items():
        if "modules_to_save" in key:
            raise AdapterError(f"{source}: {key} is a fully trained module (modules_to_save): expected "
                               "only lora_A / lora_B tensors")
        m = KEY.fullmatch(key.removeprefix(PREFIX))
        if m is None:
            raise AdapterError(f"{source}: unexpected tensor {key}: expected only "
                               f"{PREFIX}<module>.lora_A.weight / .lora_B.weight")
        names.add(m["name"])
        module = m["module"]
        base = arch(model_type).base_prefix
        if not module.startswith(base):
            module = base + module  # an adapter made on the bare base model (GPT2Model) rather than the LM
        halves.setdefault(module, {})[m["ab"]] = np.asarray(t, np.float32)
    if len(names) > 1:
        raise AdapterError(f"{source}: tensors of several adapters ({', '.join(sorted(map(str, names)))}): "
                           "expected one")
    if not halves:
        raise AdapterError(f"{source}: no lora_A / lora_B tensors: expected a LoRA adapter's weights")
    out = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{source}: {module} has lora_{''.join(ab)} only: expected lora_A and lora_B")
        out[module] = (ab["A"], ab["B"])
    return out
