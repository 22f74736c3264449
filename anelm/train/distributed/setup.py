"""Data-parallel start: rank 0 prepares the run, every other rank receives it.

Rank 0 alone touches the run folder (a fresh run's config.json and tokenizer, or `--resume`'s
latest checkpoint). It broadcasts a manifest (settings, model config, the tokenizer file's
bytes, the checkpoint's non-tensor state) and then every tensor: the weights (for a finetune,
the adapters and the frozen base), and on resume the AdamW moments. So all ranks start from rank 0's weights and state, even when
`--init-from` or the run folder exists on rank 0's machine only.

Each other rank reads `--data` itself (the same path on every machine; the token cache makes
a second read cheap) with rank 0's tokenizer (and its chat template), and the ranks compare a digest of the tokens:
another corpus would silently train on other batches. Any rank's problem, and rank 0's
setup errors, end every rank with the same one line.
"""

from __future__ import annotations

import tempfile
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from ...errors import AnelmError, UsageError
from ..checkpoint import Checkpoint
from ..data.examples import load_data
from ..init import model_config
from ..run import TOKENIZER_FILES, RunSetup

TOKENIZER_EXTRAS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
from ..settings import TrainSettings


def share_setup(group, make: Callable[[], RunSetup]) -> RunSetup:
    """`make()` on rank 0, its result on every rank (errors raised on every rank alike)."""
    if group.is_main:
        try:
            setup = make()
            manifest = _manifest(setup)
        except (AnelmError, OSError, ValueError) as e:
            group.broadcast_object({"error": str(e), "usage": isinstance(e, UsageError)})
            raise
        group.broadcast_object(manifest)
        arrays = _arrays(setup.params, setup.checkpoint, setup.frozen)
    else:
        manifest = group.broadcast_object(None)
        if "error" in manifest:
            raise (UsageError if manifest["usage"] else AnelmError)(manifest["error"])
        arrays = {n: np.empty(shape, np.float32) for n, shape in manifest["arrays"].items()}
    group.broadcast_arrays(arrays)
    problem = None
    if not group.is_main:
        setup, problem = _follower(manifest, arrays, group.rank)
    group.agree(problem)
    return setup


def tokens_digest(tokens: np.ndarray) -> tuple[int, int]:
    """(count, CRC-32 of the ids): one pass, cheap next to tokenizing."""
    return len(tokens), zlib.crc32(np.ascontiguousarray(tokens).data)


# ------------------------------------------------------------------------ rank 0

def _arrays(params: dict, ck: Checkpoint | None, frozen: dict | None = None) -> dict[str, np.ndarray]:
    out = {f"w.{n}": p for n, p in params.items()}
    out.update({f"f.{n}": np.ascontiguousarray(p, dtype=np.float32) for n, p in (frozen or {}).items()})
    if ck is not None:
        out.update({f"opt.{n}": np.ascontiguousarray(a, dtype=np.float32) for n, a in ck.optimizer.items()})
    return out


def _manifest(setup: RunSetup) -> dict:
    tok = next((setup.run / n for n in TOKENIZER_FILES if (setup.run / n).exists()), None)
    # beside it, what a tokenizer reads from its folder: the chat template JSONL records go through
    extras = [(n, (setup.run / n).read_bytes()) for n in TOKENIZER_EXTRAS if tok and (setup.run / n).is_file()]
    ck = setup.checkpoint
    state = None
    if ck is not None:
        state = {"step": ck.step, "optimizer_state": ck.optimizer_state, "scaler": ck.scaler,
                 "rng": ck.rng, "data": ck.data, "extra": ck.extra}
    return {"run": str(setup.run), "settings": setup.settings.to_dict(), "config": setup.config,
            "tokenizer": [(tok.name, tok.read_bytes()), *extras] if tok else None,
            "tokens": tokens_digest(setup.data.tokens), "checkpoint": state,
            "arrays": {n: tuple(a.shape) for n, a in _arrays(setup.params, ck, setup.frozen).items()}}


# ------------------------------------------------------------------ other ranks

def _follower(m: dict, arrays: dict[str, np.ndarray], rank: int) -> tuple[RunSetup | None, str | None]:
    """This rank's RunSetup from rank 0's manifest and tensors, and a problem (or None)."""
    settings = TrainSettings(**m["settings"])
    args = settings.resolved()
    try:
        with tempfile.TemporaryDirectory(prefix="anelm-rank-") as tmp:
            tok = None
            for k, (name, data) in enumerate(m["tokenizer"] or ()):
                (Path(tmp) / name).write_bytes(data)
                tok = Path(tmp) / name if k == 0 else tok
            ds = load_data(args.data, args.seq_len, valid_data=args.valid_data, train_on_prompt=args.train_on_prompt,
                           tokenizer=tok, notice=lambda msg: None)  # rank 0 said it
    except (AnelmError, OSError) as e:
        return None, f"rank {rank}: {e}"
    if tokens_digest(ds.tokens) != tuple(m["tokens"]):
        return None, (f"rank {rank}: --data {ds.source} gives {len(ds.tokens)} tokens that differ from "
                      f"rank 0's {m['tokens'][0]}; expected the same data on every machine")
    params = {n[2:]: a for n, a in arrays.items() if n.startswith("w.")}
    frozen = {n[2:]: a for n, a in arrays.items() if n.startswith("f.")} or None  # finetune: the base
    ck = None
    if m["checkpoint"] is not None:
        ck = Checkpoint(config=m["config"], weights=params,
                        optimizer={n[4:]: a for n, a in arrays.items() if n.startswith("opt.")},
                        **m["checkpoint"])
    setup = RunSetup(Path(m["run"]), settings, args, m["config"], model_config(m["config"]),
                     params, ds, ds.tokenizer, ck, frozen=frozen)
    return setup, None
