"""Checkpoints: `RUN/checkpoints/step-000123.safetensors` (docs/training.md).

One safetensors file holds the weights under their HF names, the AdamW moments under
`optimizer.exp_avg.<name>` / `optimizer.exp_avg_sq.<name>`, and as metadata (JSON strings)
the config, the step, the AdamW step and hyperparameters, the loss-scale state, the RNG state
and the data position, so `--resume` continues exactly.

Writes are atomic: a temp file in the same folder, fsync, `os.replace`, fsync of the folder.
A crash at any moment leaves the previous checkpoints intact, and `latest_checkpoint` never
sees a half-written file. The file is streamed tensor by tensor
(`models.safetensors_io.save_safetensors`), so saving a model never holds a second copy of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the RUN folder's checkpoints are found where the loaders read them (models/loading.py)
from ..models.loading import latest_checkpoint, list_checkpoints  # noqa: F401 - latest_checkpoint re-exported
from ..models.formats.safetensors_io import SafetensorsError, read_safetensors, save_safetensors
from .errors import CheckpointError

FORMAT = "anelm.checkpoint/1"
OPT_PREFIX = "optimizer."
# config keys that fix tensor shapes or meaning; a checkpoint must agree on all of them
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


@dataclass
class Checkpoint:
    step: int                                   # optimizer steps completed
    config: dict                                # HF config.json fields (+ training args)
    weights: dict[str, np.ndarray]              # HF names, PyTorch orientation
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)  # AdamW.state_dict()[0]
    optimizer_state: dict = field(default_factory=dict)             # AdamW.state_dict()[1]
    scaler: dict = field(default_factory=dict)  # loss scaler state_dict()
    rng: dict = field(default_factory=dict)     # e.g. {"data": Batcher.state_dict()["rng"]}
    data: dict = field(default_factory=dict)    # data position, e.g. {"drawn": 123}
    extra: dict = field(default_factory=dict)   # anything else the trainer wants back


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}.safetensors"


# ------------------------------------------------------------------------------ saving

def save_checkpoint(run_dir: str | Path, ckpt: Checkpoint, keep_last: int | None = 3) -> Path:
    """Write `ckpt` atomically, then delete all but the newest `keep_last` (None/0: keep all)."""
    path = checkpoint_path(run_dir, ckpt.step)
    tensors = dict(ckpt.weights)
    for name, arr in ckpt.optimizer.items():
        tensors[OPT_PREFIX + name] = arr
    meta = {"format": FORMAT, "step": str(ckpt.step), "config": json.dumps(ckpt.config),
            "optimizer": json.dumps(ckpt.optimizer_state), "scaler": json.dumps(ckpt.scaler),
            "rng": json.dumps(ckpt.rng), "data": json.dumps(ckpt.data),
            "extra": json.dumps(ckpt.extra)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(path.parent)
        save_safetensors(path, tensors, meta, durable=True)  # temp file, fsync, rename, fsync the folder
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}; "
                              "expected a writable run folder") from None
    if keep_last:
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            old.unlink(missing_ok=True)
    return path


def _remove_stale_temps(d: Path) -> None:
    # a process killed mid-write leaves its temp file behind; only ours match this pattern
    for p in d.glob(".step-*.tmp"):
        p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- loading

def load_checkpoint(path: str | Path, config: dict | None = None,
                    shapes: dict[str, tuple] | None = None) -> Checkpoint:
    """Read a checkpoint; with `config` / `shapes`, refuse one made for another model."""
    path = Path(path)
    meta, tensors = _read(path)
    try:
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        ck = Checkpoint(step=int(meta["step"]), config=json.loads(meta["config"]), weights={},
                        optimizer_state=json.loads(meta["optimizer"]),
                        scaler=json.loads(meta["scaler"]), rng=json.loads(meta["rng"]),
                        data=json.loads(meta["data"]), extra=json.loads(meta["extra"]))
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has bad metadata ({e}); "
                              f"expected a {FORMAT} file written by anelm train") from None
    for name, a in tensors.items():
        if name.startswith(OPT_PREFIX):
            ck.optimizer[name[len(OPT_PREFIX):]] = a
        else:
            ck.weights[name] = a
    if config is not None:
        _check_config(path, ck.config, config)
    if shapes is not None:
        _check_shapes(path, ck.weights, shapes)
    return ck


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return read_safetensors(path)
    except SafetensorsError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt ({e}); "
                              "expected a safetensors file written by anelm train") from None


def _check_config(path: Path, got: dict, want: dict) -> None:
    # keys only one side spells out are left to the shape check (they have defaults)
    for key in SHAPE_KEYS:
        if key in got and key in want:
            if got[key] != want[key]:
                raise CheckpointError(f"checkpoint {path} has {key}={got.get(key)!r} but the model "
                                      f"has {key}={want.get(key)!r}; expected the same model config")


def _check_shapes(path: Path, weights: dict[str, np.ndarray], shapes: dict[str, tuple]) -> None:
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has unexpected tensor {extra[0]}"
        raise CheckpointError(f"checkpoint {path} {what}; expected the model's {len(shapes)} weights")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != tuple(shape):
            raise CheckpointError(f"checkpoint {path}: {name} has shape {list(weights[name].shape)}, "
                                  f"expected {list(shape)}")
