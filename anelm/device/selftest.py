"""The ANE self-test behind `--device auto`: run in a child process, its verdict cached.

A private call the framework does not expect can raise an Objective-C exception or crash
with SIGSEGV, and either kills the whole process. So the first self-test runs where the
doctor runs its probes, in a child (`device/isolate.py`), and the user's process
only reads the answer: passed, failed (why), or the child died (how). The verdict is kept
in the cache directory, one file per machine, OS build and anelm version, so later runs
start at once; a new macOS build or a new anelm tests again.

    ok, reason = verdict()      # (True, "...") or (False, "the self-test crashed its process (...)")
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

from ..caches import cache_dir

SELF_TEST_TIMEOUT_S = 120.0  # a cold compile takes 15-70 ms; aned can be slow after boot


def identity() -> dict:
    """What a verdict holds for: this machine, this OS build (uname's version string names the
    kernel build, which changes with every macOS update) and this anelm."""
    from .. import __version__  # noqa: PLC0415

    u = platform.uname()
    return {"node": u.node, "system": u.system, "release": u.release, "os_build": u.version,
            "machine": u.machine, "anelm": __version__}


def verdict_path(ident: dict | None = None) -> Path:
    key = hashlib.sha256(json.dumps(ident or identity(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(f"ane-self-test-{key}.json")


def verdict(timeout: float = SELF_TEST_TIMEOUT_S) -> tuple[bool, str]:
    """(passed, reason): the cached verdict for this machine and OS build, else a fresh one."""
    path = verdict_path()
    cached = _read(path)
    if cached is None:
        ok, reason = run_in_child(timeout)
        _write(path, {"ok": ok, "reason": reason, **identity()})
        return ok, reason
    ok, reason = cached
    return ok, reason if ok else f"{reason} (verdict cached in {path}; delete it to test again)"


def run_in_child(timeout: float = SELF_TEST_TIMEOUT_S) -> tuple[bool, str]:
    """Run `AneDevice.self_test()` in a child process; never raises, never crashes this one."""
    from ..chip.profile import STRICT  # noqa: PLC0415
    from .isolate import run_child  # noqa: PLC0415 - the one child runner, the doctor's too

    request = {"kind": "ane", "profile": json.loads(STRICT.to_json()), "self_test": True, "uncapped": True}
    try:
        res = run_child(request, timeout)
    except OSError as e:  # the child could not even start
        return False, f"the self-test could not start a child process: {e}"
    if res.self_test == "":
        return True, "the backend passed its self-test"
    if res.self_test:
        return False, f"the self-test failed: {res.self_test}"
    return False, f"the self-test crashed its process ({res.error or 'no answer from the child'})"


def _read(path: Path) -> tuple[bool, str] | None:
    try:
        d = json.loads(path.read_text())
        return (bool(d["ok"]), str(d["reason"])) if d.get("os_build") == identity()["os_build"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no verdict yet, or an unreadable one: test again


def _write(path: Path, record: dict) -> None:
    from ..atomic import atomic_open  # noqa: PLC0415

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:
        pass  # a read-only cache only costs the next run a fresh self-test
