"""Pick the device a program runs on: the real ANE when it works, the emulator otherwise.

    device = get_device("auto")   # prints `anelm: device: ...` on stderr

`auto` uses the ANE only when its backend imports, reports itself available and passes its
self-test (run in a child process, the verdict cached per machine, OS build and source); anything
short of that falls back to the emulator, with the reason on stderr.
Asking for `ane` explicitly when it cannot run is a one-line DeviceError.
"""

from __future__ import annotations

import sys

from ..chip.profile import ChipProfile, load_profile
from ..errors import DeviceError, UsageError
from .base import Device

DEVICE_NAMES = ("auto", "ane", "emulator")


def _try_ane(profile: ChipProfile) -> tuple[Device | None, str]:
    """(device, "") when the real backend works, else (None, reason).

    The self-test runs in a child process (`selftest.verdict`, cached per machine, OS build
    and source): an Objective-C exception or a SIGSEGV there costs the child, not this process.
    """
    try:
        from . import ane  # noqa: PLC0415 - only on demand: it binds private frameworks
        from .ane import selftest  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - a missing or broken backend is a reason, not a crash
        return None, f"backend did not import: {type(e).__name__}: {e}"
    try:
        ok, reason = ane.available()
        if not ok:
            return None, str(reason).splitlines()[0] if reason else "unavailable"
        ok, reason = selftest.verdict()
        if not ok:
            return None, reason.splitlines()[0]
        return ane.AneDevice(profile), ""
    except Exception as e:  # noqa: BLE001 - DeviceError or anything the private API throws
        return None, f"{type(e).__name__}: {e}".splitlines()[0]


def get_device(name: str = "auto", profile: ChipProfile | str | None = None) -> Device:
    """A Device by name (`auto`, `ane`, `emulator`) under `profile` (default: ANELM_PROFILE or strict)."""
    if name not in DEVICE_NAMES:
        raise UsageError(f"--device {name!r}: expected one of {', '.join(DEVICE_NAMES)}")
    if not isinstance(profile, ChipProfile):
        profile = load_profile(profile)
    if name in ("auto", "ane"):
        dev, reason = _try_ane(profile)
        if dev is not None:
            _notice("ane")
            return dev
        if name == "ane":
            raise DeviceError(f"--device ane requested but the Apple Neural Engine is unavailable: {reason}")
        return _emulator(profile, f"no Apple Neural Engine: {reason}")
    return _emulator(profile, "requested")


def _emulator(profile: ChipProfile, reason: str) -> Device:
    from .emulator import Emulator  # noqa: PLC0415 - keeps `import select` light

    _notice(f"emulator ({reason})")
    return Emulator(profile)


def _notice(what: str) -> None:
    print(f"anelm: device: {what}", file=sys.stderr, flush=True)
