"""Atomic file writes: a temp file in the same folder, renamed over the target when complete
(`atomic_open`); a whole folder, built beside its target (`atomic_dir`).

A process killed mid-write leaves the old file (or none) and a stray `.<name>.*.tmp`, never a
half-written target. `durable=True` also fsyncs the file and the folder, for checkpoints.
"""

from __future__ import annotations

import os
import shutil
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


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Build a folder in a temp sibling (yielded) that replaces `path` when the block completes.

    The old folder stays untouched until the build is complete; then it is moved aside, the
    new one renamed into place and the old one deleted. A folder cannot be renamed over a
    non-empty one, so two renames replace it: a process killed between them leaves the old
    folder whole beside the new (`.<name>.*.old`), never a mixed one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old)  # onto the empty placeholder: rename may replace an empty folder
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
