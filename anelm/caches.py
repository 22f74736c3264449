"""The one folder for everything anelm caches (docs/caching.md): token caches and numba's
compiled loops.

It is `$ANELM_CACHE_DIR`, else `$XDG_CACHE_HOME/anelm`, else `~/.cache/anelm`, read when asked
so a changed environment takes effect. Nothing is written inside the installed package: numba,
left alone, writes `*.nbi`/`*.nbc` beside the source in `__pycache__`, and when pip later
removes the package those files keep its folder alive as a namespace package that has no
`__version__`, which breaks every `anelm` command.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash

from .atomic import atomic_open


def cache_dir(*parts: str) -> Path:
    """The cache folder (an absolute path, not created here), or a subfolder of it. Remembered
    by what it is made from (the paths cost ~30 us a call, and every program load asks)."""
    env = os.environ
    own, xdg = env.get("ANELM_CACHE_DIR"), env.get("XDG_CACHE_HOME")
    try:
        cwd = os.getcwd()  # what a relative ANELM_CACHE_DIR is relative to
    except OSError:
        cwd = None  # the working folder was removed: an absolute root does not need it
    at = (parts, own, xdg, env.get("HOME"), cwd)  # HOME: what Path.home() reads
    found = _DIRS.get(at)
    if found is None:
        if own:
            root = Path(own).expanduser()
        elif xdg and Path(xdg).is_absolute():  # the XDG spec says to ignore a relative one
            root = Path(xdg) / "anelm"
        else:
            root = Path.home() / ".cache" / "anelm"
        if len(_DIRS) >= 64:
            _DIRS.clear()  # a test suite's many folders
        found = _DIRS[at] = root.absolute().joinpath(*parts)
    return found


_DIRS: dict[tuple, Path] = {}


def warn_if_unwritable() -> None:
    """Say once per folder and process when the cache folder cannot be written. The stores
    fail quietly there (a read-only or full disk costs the cache, not the run), so nothing else
    would tell why every run compiles from scratch, ~3x slower."""
    root = cache_dir()
    if root in _CHECKED:
        return
    _CHECKED.add(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        print(f"anelm: warning: cache folder {root} is not writable: {e.strerror or e}; runs compile "
              "from scratch (set ANELM_CACHE_DIR to a writable folder)", file=sys.stderr, flush=True)


_CHECKED: set[Path] = set()


def send_numba_caches_here() -> None:
    """Point numba's on-disk cache at `cache_dir("numba")`, unless the user chose a place.

    numba picks a function's cache folder when `@njit(cache=True)` decorates it, from its
    config, which it reads from the environment at import and again before each compile. So
    this runs when `anelm` is imported, before any anelm module defines a compiled loop, and
    refreshes numba's config in case numba was imported first.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    os.environ["NUMBA_CACHE_DIR"] = str(cache_dir("numba"))
    if "numba" in sys.modules:
        from numba.core import config

        config.reload_config()


def load_compiled(fn: Any, *signatures: tuple) -> None:
    """Have numba dispatcher `fn` ready for these argument types now, from numba's cache (or
    compiled, when the cache is cold), as its module is imported: the load costs 4-10 ms a
    function, and at the first call it fell inside the first prefill or decode a new
    `anelm generate` timed. Other argument types still compile on their first call."""
    for sig in signatures:
        fn.compile(sig)


# --- what the code is: a key part of the caches that depend on it (the program store, the
# ANE self-test's verdict)

@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A digest of every source file of the anelm package (code, grammar, bundled data), once
    per process (`tree_fingerprint`)."""
    return tree_fingerprint(os.path.dirname(os.path.abspath(__file__)))


def tree_fingerprint(root: str) -> str:
    """A digest of the sources under `root`. Reading ~1 MB of them takes 20-60 ms here, their
    sizes and modification times ~3 ms: the digest is remembered in the cache folder under a
    digest of those (as git's index trusts a file whose stat is unchanged) and read back while
    they stay the same."""
    files, stats = _source_files(root), xxhash.xxh3_128()
    newest = 0
    for rel, path in files:
        st = os.stat(path)
        stats.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        newest = max(newest, st.st_mtime_ns)
    memo = cache_dir("programs", "sources") / f"{stats.hexdigest()}.txt"
    try:
        text = memo.read_text(encoding="ascii")
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
    except (OSError, UnicodeDecodeError):
        pass
    h = xxhash.xxh3_128()
    for rel, path in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(rel.encode() + b"\0" + _LENGTH.pack(len(data)))
        h.update(data)
    fingerprint = h.hexdigest()
    # a file changed within the clock's resolution of this read could keep its stat: such a
    # fresh tree is hashed again next time rather than trusted (git's "racy" rule)
    if time.time_ns() - newest > _RACY_NS:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(memo, "w", encoding="ascii") as f:
                f.write(fingerprint)
        except OSError:
            pass  # a read-only cache costs the shortcut, not the key
    return fingerprint


_LENGTH = struct.Struct("<Q")  # a file's length, before its bytes in the digest
_RACY_NS = 2_000_000_000  # coarser than any filesystem's modification-time granularity


def _source_files(root: str) -> list[tuple[str, str]]:
    """(path relative to the package, path) of its sources, in a fixed order (plain strings:
    pathlib's parsing alone cost 10 ms over the package)."""
    out = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")  # a walk in a fixed order
        for name in sorted(f for f in files if f.endswith((".py", ".lark", ".json"))):
            path = os.path.join(folder, name)
            out.append((path[len(root) + 1:], path))
    return out
