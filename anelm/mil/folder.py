"""The compile folder a MIL program runs from: `model.mil` and its blobs at the paths the MIL
names after `@model_path/` (docs/architecture.md). The private API compiles from such a
folder, the emulator keeps one per program, and a kernel folder (compiler/artifact.py) is one
plus its signature; all of them are written by `write_model_folder`.

    FOLDER/model.mil          UTF-8 MIL text
    FOLDER/weights/w.bin      the blob the MIL names `@model_path/weights/w.bin`
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from ..errors import BlobError

MODEL_PATH = "@model_path/"  # the MIL's name for the compile folder
WEIGHTS_DIR = MODEL_PATH + "weights"  # where the compiler puts each blob const
MODEL_FILE = "model.mil"


def relative_path(key: str) -> str:
    """`@model_path/weights/w.bin` -> `weights/w.bin`, refusing keys that leave the folder."""
    rel = PurePosixPath(key[len(MODEL_PATH):])
    if not key.startswith(MODEL_PATH) or not rel.parts or rel.is_absolute() or ".." in rel.parts:
        raise BlobError(f"weight path '{key}' must start with {MODEL_PATH} and stay inside the kernel folder")
    return str(rel)


def weight_file(folder: str | os.PathLike, key: str) -> Path:
    """Where the blob the MIL names `key` lives inside `folder`."""
    return Path(folder).joinpath(*PurePosixPath(relative_path(key)).parts)


def write_model_folder(folder: str | os.PathLike, mil_text: str | bytes, weights: dict[str, bytes]) -> Path:
    """`model.mil` and every blob (any bytes-like object) into `folder`; every key is checked
    before anything is written."""
    folder = Path(folder)
    files = {weight_file(folder, key): blob for key, blob in weights.items()}
    (folder / "weights").mkdir(parents=True, exist_ok=True)
    (folder / MODEL_FILE).write_bytes(mil_text.encode("utf-8") if isinstance(mil_text, str) else mil_text)
    for path, blob in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    return folder
