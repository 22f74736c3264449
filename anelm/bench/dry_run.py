"""`anelm train --dry-run`: the predicted step time per chip for the run the flags describe.

Only the host compiler runs (to read the kernels' cost annotations); no device is opened and
no run folder is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..chip.catalog import chip_names, get_chip
from .step_model import anelm_spec, predict_step


def dry_run(explicit: dict) -> int:
    from ..train.presets import TRAIN_DEFAULTS, get_preset
    from ..train.settings import TrainSettings

    preset = explicit.get("preset") or "tiny"
    if explicit.get("init_from"):
        cfg = json.loads((Path(explicit["init_from"]) / "config.json").read_text())
        defaults = {}
    else:
        cfg, defaults = get_preset(preset), TRAIN_DEFAULTS.get(preset, {})
    s = TrainSettings.merge(explicit, None, defaults).resolved()
    # `--head-on auto` as the model resolves it for each chip (train/steps/placement.py)
    spec = anelm_spec(cfg, s.seq_len, s.batch_size, s.grad_accum, s.pipeline, s.head_on)
    print(f"anelm: dry run: {explicit.get('init_from') or preset}, {s.batch_size}x{s.seq_len} tokens "
          f"x{s.grad_accum} accum, {s.pipeline} pipeline, {s.steps} steps", file=sys.stderr)
    for key in chip_names():
        ms = predict_step(spec, get_chip(key))["predicted_step_ms"]
        print(f"{key:7s} predicted {ms:9.1f} ms/step, {ms * s.steps / 60e3:7.1f} min for the run")
    return 0
