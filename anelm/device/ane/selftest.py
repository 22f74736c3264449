"""The ANE self-test behind `--device auto`: run in a child process, its verdict cached.

A private call the framework does not expect can raise an Objective-C exception or crash
with SIGSEGV, and either kills the whole process. So the first self-test runs where the
doctor runs its probes, in a child (`device/isolate.py`), and the user's process
only reads the answer: passed, failed (why), or the child died (how). The verdict is kept
in the cache directory, one file per machine, OS build and anelm source (the fingerprint the
program store keys on), so later runs start at once; a new macOS build or any edit to anelm
tests again. A pass is kept; a failure only for FAILED_VERDICT_S (it may be passing: aned
busy after boot, a wedge), and `anelm doctor` writes the verdict of the self-test it ran.

    ok, reason = verdict()      # (True, "...") or (False, "the self-test crashed its process (...)")
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from pathlib import Path

from ... import caches
from ...caches import cache_dir

SELF_TEST_TIMEOUT_S = 120.0  # a cold compile takes 15-70 ms; aned can be slow after boot
FAILED_VERDICT_S = 300.0  # how long a failure is replayed before the next run tests again


def identity() -> dict:
    """What a verdict holds for: this machine, this OS build (uname's version string names the
    kernel build, which changes with every macOS update) and this anelm's source files."""
    source = caches.source_fingerprint()  # the program store's key part too: one fingerprint
    u = platform.uname()
    return {"node": u.node, "system": u.system, "release": u.release, "os_build": u.version,
            "machine": u.machine, "source": source}


def verdict_path(ident: dict | None = None) -> Path:
    key = hashlib.sha256(json.dumps(ident or identity(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(f"ane-self-test-{key}.json")


def verdict(timeout: float = SELF_TEST_TIMEOUT_S) -> tuple[bool, str]:
    """(passed, reason): the cached verdict for this machine, OS build and source, else a fresh one."""
    ident = identity()
    path = verdict_path(ident)
    cached = _read(path, ident)
    if cached is None:
        ok, reason = run_in_child(timeout)
        record(ok, reason, ident)
        return ok, reason
    ok, reason = cached
    return ok, reason if ok else (f"{reason} (verdict cached in {path} for {FAILED_VERDICT_S / 60:.0f} "
                                  "minutes; delete it to test again)")


def record(ok: bool, reason: str, ident: dict | None = None) -> None:
    """Keep a verdict for later runs; `anelm doctor` records the self-test it ran."""
    ident = ident or identity()
    _write(verdict_path(ident), {"ok": ok, "reason": reason, "at": time.time(), **ident})


def run_in_child(timeout: float = SELF_TEST_TIMEOUT_S) -> tuple[bool, str]:
    """Run `AneDevice.self_test()` in a child process; never raises, never crashes this one."""
    from ...chip.profile import STRICT  # noqa: PLC0415
    from ..isolate import run_child  # noqa: PLC0415 - the one child runner, the doctor's too

    request = {"kind": "ane", "profile": json.loads(STRICT.to_json()), "self_test": True, "uncapped": True}
    try:
        res = run_child(request, timeout)
    except OSError as e:  # the child could not even start
        return False, f"the self-test could not start a child process: {e}"
    return judge(res)


def judge(res) -> tuple[bool, str]:
    """(passed, reason) from a child's answers (`isolate.Isolated`), the doctor's too."""
    if res.self_test == "":
        return True, "the backend passed its self-test"
    if res.self_test:
        return False, f"the self-test failed: {res.self_test}"
    return False, f"the self-test crashed its process ({res.error or 'no answer from the child'})"


def _read(path: Path, ident: dict) -> tuple[bool, str] | None:
    try:
        d = json.loads(path.read_text())
        if any(d.get(k) != v for k, v in ident.items()):
            return None
        if not d["ok"] and not 0 <= time.time() - float(d["at"]) < FAILED_VERDICT_S:
            return None  # an old failure: test again
        return bool(d["ok"]), str(d["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no verdict yet, or an unreadable one: test again


def _write(path: Path, data: dict) -> None:
    from ...atomic import atomic_open  # noqa: PLC0415

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass  # a read-only cache only costs the next run a fresh self-test
