"""`load_model(path)`: an HF folder, a RUN folder, one checkpoint file, a llama2.c `.bin` or a
GGUF file (`gguf.py`, which carries its own tokenizer); an HF repo id (`owner/name`, or
`owner/name:FILE.gguf`) names a folder or file of the HF cache (`hub.py`).

Every route ends the same way: the architecture's `sanitize` maps the checkpoint's keys and
orientation to ours, and `check_weights` names any missing key or wrong shape. The model
class comes from the module named by `model_type` (`anelm/models/<model_type>.py`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from .base import CausalLM, check_weights
from .config import ModelConfig, config_from_dict
from .errors import LoadError
from .formats.llama2c import read_llama2c
from .formats.quantized import QuantizedWeights, quant_config, scheme_of, unpack
from .registry import architecture
from .formats.safetensors_io import SafetensorsError, read_safetensors
from .tokenizer import find_tokenizer, load_tokenizer
from .tokenizer.base import Tokenizer

KINDS = "an HF folder, a RUN folder, a quantized folder, a llama2.c .bin or a .gguf file"
STEP_FILE = re.compile(r"step-(\d+)\.safetensors")


def build_model(config: ModelConfig, weights: dict[str, np.ndarray]) -> CausalLM:
    """The CPU reference model (a Runner) for sanitized weights."""
    return architecture(config.model_type).Model(config, weights)


def load_model(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None
               ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """(config, float32 weights under HF names after `sanitize`, tokenizer or None).

    The tokenizer is `tokenizer` when given, else the one in the model's folder (for a
    llama2.c `.bin`, a `tokenizer.bin` or `tokenizer.model` beside it; a GGUF holds its own).
    """
    p = Path(path)
    if not p.exists():
        from .hub import resolve  # `owner/name` or `owner/name:FILE.gguf`: from the HF cache

        p = resolve(path)
        if p is None:
            raise LoadError(f"model not found: {path}: expected {KINDS}, or an HF repo id")
    tok = None
    if p.is_file() and p.suffix == ".gguf":
        from .formats.gguf import read_gguf

        (config, raw, tok), tok_dir = read_gguf(p), None
    elif p.is_dir():
        (config, raw), tok_dir = _read_folder(p), p
    elif p.suffix == ".bin":
        (config, raw), tok_dir = read_llama2c(p), p.parent
    elif p.suffix == ".safetensors":
        tok_dir = p.parent.parent if p.parent.name == "checkpoints" else p.parent
        config = read_config(tok_dir)
        raw = read_weight_files([p], set(architecture(config.model_type).expected_shapes(config)))
    else:
        raise LoadError(f"cannot read model file {p}: expected {KINDS}")
    plan = None
    if p.is_dir() and (qc := quant_config(p)) is not None:  # anelm quantize's folder: int8 + scales
        raw, plan = unpack(raw, config, scheme_of(qc, str(p)), str(p))
    arch = architecture(config.model_type)
    sane, raw = arch.sanitize(raw, config), None  # the sanitized dict alone holds the tensors now
    weights = check_weights(sane, arch.expected_shapes(config), str(p), consume=True)
    if plan is not None:
        weights = QuantizedWeights(weights)
        weights.quant = plan
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif tok_dir is not None:
        tok = find_tokenizer(tok_dir)
    return config, weights, tok


def read_config(folder: Path) -> ModelConfig:
    f = folder / "config.json"
    if not f.is_file():
        raise LoadError(f"no config.json in {folder}: expected {KINDS}")
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{f}: not valid JSON ({e})") from None
    return config_from_dict(d, str(f), complete=True)


def list_checkpoints(run: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete `checkpoints/step-N.safetensors` of a RUN folder, oldest
    first (temp files are not matched)."""
    d = Path(run) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in d.iterdir() if (m := STEP_FILE.fullmatch(p.name)))


def latest_checkpoint(run: str | os.PathLike) -> Path | None:
    """The checkpoint of a RUN folder with the highest step, or None."""
    found = list_checkpoints(run)
    return found[-1][1] if found else None


def _read_folder(d: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config = read_config(d)
    ckpt = latest_checkpoint(d)
    if ckpt is not None:
        # A training checkpoint also holds optimizer state: read only the model's tensors.
        return config, read_weight_files([ckpt], set(architecture(config.model_type).expected_shapes(config)))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return config, read_weight_files(_shards(index))
    if (d / "model.safetensors").is_file():
        return config, read_weight_files([d / "model.safetensors"])
    other = [f.name for f in d.glob("*.bin")] + [f.name for f in d.glob("*.pt*")]
    found = f" (found {', '.join(sorted(other))}; only safetensors are read)" if other else ""
    raise LoadError(f"no weights in {d}: expected model.safetensors, model.safetensors.index.json "
                    f"or checkpoints/step-*.safetensors{found}")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise LoadError(f"{index}: expected a JSON object with a weight_map ({e})") from None
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise LoadError(f"{index}: shard {f.name} is missing")
    return files


def read_weight_files(files: list[Path], names: set[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of `files` (only `names` when given) as numpy; bf16 widened to float32."""
    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            out.update(read_safetensors(f, names)[1])
        except SafetensorsError as e:
            raise LoadError(f"{f}: not a readable safetensors file ({e})") from None
    return out
