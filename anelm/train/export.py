"""`anelm export RUN --out DIR`: a training run (or a GGUF file) as a Hugging Face model folder.

    DIR/config.json              HF field names, `architectures`, float32
    DIR/model.safetensors        the latest checkpoint's weights (no optimizer state), or the
                                 GGUF's dequantized ones, in HF's checkpoint layout
    DIR/tokenizer.json ...       the run's tokenizer files, copied as they are; for a GGUF, the
                                 tokenizer rebuilt from its metadata + tokenizer_config.json
                                 (special tokens, chat template)
    DIR/generation_config.json   BOS/EOS ids

`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads it. For a finetune RUN (one
with `adapter/`, docs/fine-tuning.md) DIR is the PEFT adapter folder instead, which
`peft.PeftModel.from_pretrained(base, DIR)` loads; `merge=True` writes the whole HF folder
above with the adapter folded into the base's weights (W += alpha/r · B·A). The folder is built in a
temporary sibling and renamed into place, so an interrupted export leaves no half folder;
an existing non-empty DIR is refused, never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..atomic import atomic_dir
from ..errors import AnelmError
from .checkpoint import latest_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tokenizer.bin",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


class ExportError(AnelmError):
    """A run that cannot be exported, or a destination that cannot take it."""


def export_run(run: str | Path, out: str | Path, merge: bool = False,
               base: str | Path | None = None) -> tuple[Path, int | None]:
    """Write the HF folder (or a finetune RUN's adapter folder); returns (folder, the step of
    the checkpoint exported; None for a GGUF or an adapter). `base`: the model a finetune RUN
    was trained on, when it is no longer where its adapter_config.json says."""
    from ..models.loading import load_model
    from ..models.formats.quantized import refuse_quantized

    run, out = Path(run), Path(out)
    if not run.exists():
        raise ExportError(f"{run} does not exist; expected a run folder written by anelm train, one of its "
                          "checkpoint files (RUN/checkpoints/step-*.safetensors) or a .gguf file")
    refuse_quantized(run, "export")
    if run.is_dir() and (run / "adapter" / "adapter_config.json").is_file():
        return export_adapter(run, out, merge, base), None
    if merge or base is not None:
        raise ExportError(f"{run} has no adapter/ folder: --merge and --base expected a finetune RUN folder "
                          "(RUN/adapter/adapter_config.json)")
    if run.is_file() and run.suffix == ".gguf":
        config, weights, tok = load_model(run)
        return _publish(out, lambda d: write_folder(d, config, weights, tokenizer=tok)), None
    ckpt = run if run.is_file() else latest_checkpoint(run)
    if ckpt is None:
        raise ExportError(f"{run} has no checkpoints; expected a run folder written by anelm train "
                          "(RUN/checkpoints/step-*.safetensors) or a .gguf file")
    src = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    config, weights, _ = load_model(ckpt)  # one checkpoint: the weights, checked against config
    return _publish(out, lambda d: write_folder(d, config, weights, run=src)), _step_of(ckpt)


def export_adapter(run: Path, out: Path, merge: bool, base: str | Path | None) -> Path:
    """A finetune RUN's adapter as a PEFT folder, or (`merge`) folded into its base as an HF folder."""
    from ..models.adapters import merge_weights
    from ..models.formats.peft import load_peft, save_peft
    from ..models.loading import load_model, read_config

    if not merge:
        _check_destination(out)
        return save_peft(load_peft(run, read_config(run)), out)
    from ..models.errors import LoadError

    named = json.loads((run / "adapter" / "adapter_config.json").read_text()).get("base_model_name_or_path")
    base = base if base is not None else named if named and Path(named).exists() else None
    try:  # without a base named, the RUN itself: a train run's checkpoints hold a whole model
        config, weights, tok = load_model(base if base is not None else run)
    except LoadError:
        if base is not None:
            raise
        raise ExportError(f"{run}: the base model {named!r} the adapter was trained on is not found: "
                          "expected --base PATH (the model given to anelm finetune)") from None
    merged = merge_weights(weights, load_peft(run, config))
    has_tokenizer = any((run / name).is_file() for name in TOKENIZER_FILES)
    return _publish(out, lambda d: write_folder(d, config, merged, run=run if has_tokenizer else None,
                                                 tokenizer=None if has_tokenizer else tok))


def _publish(out: Path, write) -> Path:
    """`write(tmp)` into a temporary sibling of `out`, then rename it into place (`atomic_dir`:
    a killed export's leftovers go at the next one)."""
    _check_destination(out)
    with atomic_dir(out) as tmp:
        write(tmp)
    return out


def _check_destination(out: Path) -> None:
    """`out` is new or an empty folder, and its folder takes writes: checked before any work
    (quantize spends minutes before it writes)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty folder; expected a new --out "
                          "folder (nothing was overwritten)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.probe."))
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror or e}; expected a writable --out") from None


def write_folder(d: Path, config, weights: dict[str, np.ndarray], run: Path | None = None,
                  tokenizer=None) -> None:
    """The folder's files: the tokenizer files copied from `run`, or written by `tokenizer`."""
    from ..models.registry import architecture
    from ..models.formats.safetensors_io import save_safetensors

    cfg = {**config.to_dict(), "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    hf = architecture(config.model_type).unsanitize(weights, config)  # e.g. GPT-2's Conv1D as [in, out]
    # "format": "pt" is what transformers expects in a safetensors header from a torch model
    save_safetensors(d / "model.safetensors", {k: np.asarray(v, dtype=np.float32) for k, v in hf.items()},
                     metadata={"format": "pt"})
    for name in TOKENIZER_FILES if run is not None else ():
        if (run / name).is_file():
            shutil.copy2(run / name, d / name)
    if tokenizer is not None:
        tokenizer.save(d)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _step_of(ckpt: Path) -> int:
    digits = "".join(ch for ch in ckpt.stem if ch.isdigit())
    return int(digits) if digits else 0
