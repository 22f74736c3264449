"""Atomic file writes: a temp file in the same folder, renamed over the target when complete
(`atomic_open`); a whole folder, built beside its target (`atomic_dir`).

A process killed mid-write leaves the old file (or none) and a stray `.<name>.<pid>.*.tmp`,
never a half-written target; the next `atomic_dir` of the same target removes the strays of
processes that are gone (a killed export or quantize leaves gigabytes). `durable=True` also
fsyncs the file and the folder, for checkpoints.

What is written gets the modes any file or folder gets under the process's umask (0644, 0755
under 022): mkstemp and mkdtemp make theirs private (0600, 0700), which would keep weights,
metrics and plots from another user, a group or a container.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@functools.cache
def _umask() -> int:
    """The process's umask (read by setting it, so once: it does not change under anelm)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}."  # the writer's pid: a stray of a dead one can go


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", durable: bool = False, encoding: str | None = None):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
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
def atomic_dir(path: str | os.PathLike, replace: bool = True):
    """Build a folder in a temp sibling (yielded) that replaces `path` when the block completes.

    The old folder stays untouched until the build is complete; then it is moved aside, the
    new one renamed into place and the old one deleted. A folder cannot be renamed over a
    non-empty one, so two renames replace it: a process killed between them leaves the old
    folder whole beside the new (`.<name>.*.old`), never a mixed one. `replace=False` leaves
    a folder that exists by then (another process completed it first) and drops the build.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_strays(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        old = None
        if replace and path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=_prefix(path), suffix=".old"))
            os.replace(path, old)  # onto the empty placeholder: rename may replace an empty folder
        try:
            os.replace(tmp, path)
        except OSError:
            if replace or not path.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a non-empty folder made meanwhile: it stands
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sweep_strays(path: str | os.PathLike) -> None:
    """Remove what writers of `path` that are no longer running left beside it (`.<name>.<pid>.*`
    temp files and folders: a process killed mid-build)."""
    path = Path(path)
    try:
        found = list(path.parent.glob(f".{glob.escape(path.name)}.*"))
    except OSError:
        return
    for stray in found:
        pid = stray.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            if stray.is_dir() and not stray.is_symlink():
                shutil.rmtree(stray, ignore_errors=True)
            else:
                stray.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True
