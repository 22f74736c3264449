"""Atomic file writes: a temp file in the same folder, renamed over the target when complete.

A process killed mid-write leaves the old file (or none) and a stray `.<name>.*.tmp`, never a
half-written target. `durable=True` also fsyncs the file and the folder, for checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", durable: bool = False, encoding: str | None = None):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(d: str | os.PathLike) -> None:
    """Make a rename in `d` durable; some filesystems refuse fsync on a folder, which is fine."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
