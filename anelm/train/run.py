"""A run folder from the settings: model config, weights, data, tokenizer, and what to resume.

    RUN/config.json        HF model config + {"anelm_train": the settings as typed}
    RUN/tokenizer.*        the tokenizer the ids came from
    RUN/metrics.jsonl, loss.png, checkpoints/step-NNNNNN.safetensors   (written by the loop)

A fresh run refuses a folder that already holds one (nothing is overwritten); a fresh run
that fails while setting up removes the folder it created, so a retry starts clean.
`--resume` takes the model and the settings from the folder, and the state from its latest
checkpoint; a folder whose run died before its first checkpoint starts again from step 0.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..atomic import atomic_open
from ..errors import UsageError
from .checkpoint import Checkpoint, latest_checkpoint, load_checkpoint
from .data import Dataset, vocab_size_of
from .data.examples import ExampleSet, check_data, load_data
from .errors import TrainError
from .init import init_weights, load_pretrained, model_config, weight_shapes
from .presets import TRAIN_DEFAULTS, get_preset
from .settings import TrainSettings

SETTINGS_KEY = "anelm_train"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.bin")


@dataclass
class RunSetup:
    run: Path
    settings: TrainSettings      # as typed (saved in config.json, used for the restart)
    args: TrainSettings          # resolved: intervals and warmup filled in
    config: dict                 # config.json contents (HF names + settings)
    model_config: object         # the anelm.models dataclass
    params: dict[str, np.ndarray]
    data: Dataset | ExampleSet
    tokenizer: object
    checkpoint: Checkpoint | None  # the state to resume from (None: step 0)
    created: bool = False          # this call created the run folder (a fresh run into a new --out)
    frozen: dict[str, np.ndarray] | None = None  # weights the run does not train (finetune: the base)


@dataclass(frozen=True)
class Trains:
    """What a run trains, for `--resume`: the tensors its checkpoints hold and their step-0
    values. `anelm train`: every weight of the model; `anelm finetune` (train/lora.py): adapters."""

    shapes: Callable[[object, dict], dict]                 # (model config, config.json) -> name -> shape
    initial: Callable[[object, TrainSettings, dict], dict]  # (model config, settings, config.json) -> params


def prepare(explicit: dict, out: str | os.PathLike, resume: bool, extra: dict | None = None,
            trains: "Trains | None" = None) -> RunSetup:
    """Everything the trainer needs, from the typed flags (`explicit`: name → value or None).
    `extra`: more keys for a fresh run's config.json; `trains`: see `Trains` (default: weights)."""
    run = Path(out).absolute()
    if resume:
        return _resume(run, explicit, trains or WEIGHTS)
    created = not run.exists()
    try:
        setup = _fresh(run, explicit, extra or {})
        setup.created = created
        return setup
    except BaseException:
        if created:
            shutil.rmtree(run, ignore_errors=True)  # only what this attempt created
        raise


# ------------------------------------------------------------------------ fresh runs

def _fresh(run: Path, explicit: dict, extra: dict) -> RunSetup:
    if (run / "config.json").exists():
        raise TrainError(f"{run} already holds a run (config.json); expected a new --out folder, "
                         "or --resume to continue it")
    preset = explicit.get("preset") or "tiny"
    if explicit.get("init_from") and explicit.get("preset"):
        raise UsageError("--preset and --init-from both name the model; expected one of them")
    # what needs no model fails before one loads (seconds): the flags (but --warmup, judged
    # against the preset's --steps), a --data path that is not there or is empty
    TrainSettings.merge({**explicit, "warmup": None}).check()
    check_data(explicit.get("data"), explicit.get("valid_data"))
    if explicit.get("init_from"):
        cfg, weights, tok = load_pretrained(explicit["init_from"])
        if tok is None and not explicit.get("tokenizer"):
            raise TrainError(f"--init-from {explicit['init_from']} holds no tokenizer; expected "
                             "one in the folder, or --tokenizer PATH")
        defaults = {"lr": 1e-4, "seq_len": min(256, int(cfg.get("max_position_embeddings", 256)))}
    else:
        cfg, weights, tok = get_preset(preset), None, None
        defaults = TRAIN_DEFAULTS.get(preset, {})
    settings = TrainSettings.merge(explicit, None, defaults)
    args = settings.resolved()
    _check_context(args, cfg)
    _make_writable(run)
    tok_spec = args.tokenizer or tok
    ds = load_data(args.data, args.seq_len, valid_data=args.valid_data, train_on_prompt=args.train_on_prompt,
                   run_dir=run, tokenizer=tok_spec, bpe_vocab_size=args.bpe_vocab_size or int(cfg["vocab_size"]))
    if ds.tokenizer_path is not None and weights is None:
        cfg["vocab_size"] = vocab_size_of(ds.tokenizer)  # a BPE trained for this run: its size
    _special_ids(cfg, ds.tokenizer)
    ds.check_vocab(int(cfg["vocab_size"]))
    config = model_config(cfg)
    full = {**cfg, **config.to_dict(), SETTINGS_KEY: settings.to_dict(), **extra}
    _save_tokenizer(run, ds)
    write_json(run / "config.json", full)
    if weights is None:
        weights = init_weights(config, args.seed)
    return RunSetup(run, settings, args, full, config, weights, ds, ds.tokenizer, None)


def _check_context(args: TrainSettings, cfg: dict) -> None:
    ctx = int(cfg.get("max_position_embeddings", args.seq_len))
    if args.seq_len > ctx:
        raise UsageError(f"--seq-len {args.seq_len}: expected at most the model's context of {ctx} "
                         "(max_position_embeddings)")


def _make_writable(run: Path) -> None:
    # fail before any work, with one line, when --out cannot hold a run
    try:
        run.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=run, prefix=".write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TrainError(f"cannot write to run folder {run}: {e.strerror or e}; "
                         "expected a writable --out folder") from None


def _special_ids(cfg: dict, tok) -> None:
    # A preset without BOS/EOS ids (tiny) takes the tokenizer's; otherwise the model config's
    # defaults (1 and 2) would name arbitrary BPE tokens. Our BPE has one special token, the
    # story separator, which both ends a document and starts the next.
    if tok is None:
        return
    bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
    if "eos_token_id" not in cfg and eos is not None:
        cfg["eos_token_id"] = int(eos)
    if "bos_token_id" not in cfg and (bos if bos is not None else eos) is not None:
        cfg["bos_token_id"] = int(bos if bos is not None else eos)


def _save_tokenizer(run: Path, ds: Dataset) -> None:
    """The run's own copy of the tokenizer, so RUN is self-contained for generate/export."""
    tok = ds.tokenizer
    if tok is None:
        return
    if ds.tokenizer_path is None and hasattr(tok, "save"):
        tok.save(run)
    cfg_file = run / "tokenizer_config.json"
    if (run / "tokenizer.json").exists() and not cfg_file.exists():
        # our BPE's separator doubles as BOS, so `generate` with no prompt starts a document;
        # the class name lets `transformers.AutoTokenizer` read the exported folder
        specials = {}
        eot = getattr(tok, "eos_id", None)
        if eot is not None and hasattr(tok, "tok"):
            name = tok.tok.id_to_token(eot)
            specials = {"bos_token": name, "eos_token": name}
        write_json(cfg_file, {"tokenizer_class": "PreTrainedTokenizerFast", **specials})


# ----------------------------------------------------------------------------- resume

def _resume(run: Path, explicit: dict, trains: Trains) -> RunSetup:
    saved = read_json(run / "config.json", what="run config") if run.is_dir() else None
    if saved is None or SETTINGS_KEY not in saved:
        raise TrainError(f"nothing to resume in {run}: expected a run folder written by anelm train "
                         "(config.json with training settings)")
    _refuse_model_change(explicit, saved[SETTINGS_KEY])
    settings = TrainSettings.merge(explicit, saved[SETTINGS_KEY])
    args = settings.resolved()
    _check_context(args, saved)
    config = model_config(saved)
    tok_file = next((run / n for n in TOKENIZER_FILES if (run / n).exists()), None)
    ds = load_data(args.data, args.seq_len, valid_data=args.valid_data, train_on_prompt=args.train_on_prompt,
                   run_dir=run, tokenizer=tok_file or args.tokenizer,
                   bpe_vocab_size=args.bpe_vocab_size or int(saved["vocab_size"]))
    ds.check_vocab(config.vocab_size)
    full = {**saved, SETTINGS_KEY: settings.to_dict()}
    shapes = trains.shapes(config, full)
    path = latest_checkpoint(run)
    if path is None:
        params = trains.initial(config, args, full)
        ckpt = None
    else:
        ckpt = load_checkpoint(path, config=full, shapes=shapes)
        params = {k: np.ascontiguousarray(ckpt.weights[k], dtype=np.float32) for k in shapes}
    _note_changes(saved[SETTINGS_KEY], settings)  # once the run is known to be resumable
    write_json(run / "config.json", full)
    return RunSetup(run, settings, args, full, config, params, ds, ds.tokenizer, ckpt)


def _refuse_model_change(explicit: dict, saved: dict) -> None:
    for key in ("preset", "init_from"):
        if explicit.get(key) is not None and explicit[key] != saved.get(key):
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"{flag} {explicit[key]}: this run was started with {flag} "
                             f"{saved.get(key)}; expected the same model when resuming")


def _note_changes(saved: dict, now: TrainSettings) -> None:
    # allowed (e.g. more --steps), but the rest of the run then differs from a straight one
    for key, value in now.to_dict().items():
        if key in saved and saved[key] != value:
            print(f"anelm: note: --{key.replace('_', '-')} is {value} now, {saved[key]} when the run "
                  "started; the resumed run will not match an uninterrupted one", file=sys.stderr)


def _initial_weights(config, args: TrainSettings, full: dict) -> dict[str, np.ndarray]:
    # the run died before its first checkpoint: rebuild its step-0 weights
    if args.init_from:
        return load_pretrained(args.init_from)[1]
    return init_weights(config, args.seed)


WEIGHTS = Trains(lambda config, full: weight_shapes(config), _initial_weights)


# ------------------------------------------------------------------------------ files

def write_json(path: Path, obj: dict) -> None:
    """Atomically (temp file + rename), so a kill never leaves half a config.json."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def read_json(path: Path, what: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrainError(f"{what} {path} is unreadable ({e}); expected JSON written by anelm train") from None
    if not isinstance(d, dict):
        raise TrainError(f"{what} {path}: expected a JSON object")
    return d
