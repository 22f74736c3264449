"""The one folder for everything anelm caches (CONTRACTS §1): token caches and numba's
compiled loops.

It is `$ANELM_CACHE_DIR`, else `$XDG_CACHE_HOME/anelm`, else `~/.cache/anelm`, read when asked
so a changed environment takes effect. Nothing is written inside the installed package: numba,
left alone, writes `*.nbi`/`*.nbc` beside the source in `__pycache__`, and when pip later
removes the package those files keep its folder alive as a namespace package that has no
`__version__`, which breaks every `anelm` command.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


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
