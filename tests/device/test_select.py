"""get_device: auto falls back to the emulator with a reason; ane on request or a one-line error.

These run the real backend module: off Apple Silicon it reports itself unavailable, which is
the fallback path; on a Mac with an ANE the `ane`-marked test checks that auto picks it.
No stand-in pretends to be hardware.
"""

import sys

import pytest

import anelm.device
from anelm.device import ane
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.device.select import get_device
from anelm.errors import DeviceError, UsageError

HAS_ANE, WHY_NOT = ane.available()


def test_emulator_on_request(capsys):
    dev = get_device("emulator")
    assert isinstance(dev, Emulator) and dev.profile is STRICT
    assert capsys.readouterr().err == "anelm: device: emulator (requested)\n"


@pytest.mark.skipif(HAS_ANE, reason="this machine has an ANE: the fallback path does not run")
def test_auto_without_ane_uses_emulator_with_reason(capsys):
    assert isinstance(get_device("auto"), Emulator)
    err = capsys.readouterr().err
    assert err == f"anelm: device: emulator (no Apple Neural Engine: {WHY_NOT})\n" and WHY_NOT


def test_auto_when_backend_does_not_import(monkeypatch, capsys):
    """A backend that fails to import (a broken install) is a reason to fall back, not a crash."""
    monkeypatch.delattr(anelm.device, "ane", raising=False)
    monkeypatch.setitem(sys.modules, "anelm.device.ane", None)  # import now raises ImportError
    assert isinstance(get_device(), Emulator)
    err = capsys.readouterr().err
    assert err.startswith("anelm: device: emulator (no Apple Neural Engine: backend did not import") and err.count("\n") == 1


@pytest.mark.skipif(HAS_ANE, reason="this machine has an ANE")
def test_ane_requested_but_unavailable_is_one_line_error():
    with pytest.raises(DeviceError) as e:
        get_device("ane")
    assert str(e.value) == f"--device ane requested but the Apple Neural Engine is unavailable: {WHY_NOT}"


@pytest.mark.ane
@pytest.mark.skipif(not HAS_ANE, reason=f"needs a real Apple Neural Engine: {WHY_NOT}")
def test_auto_uses_working_ane(capsys):
    prof = STRICT.replace(name="m-test")
    dev = get_device("auto", prof)
    assert dev.name == "ane" and dev.profile is prof
    assert capsys.readouterr().err == "anelm: device: ane\n"


def test_bad_name_and_profile_by_path(tmp_path, capsys):
    with pytest.raises(UsageError, match="expected one of auto, ane, emulator"):
        get_device("gpu")
    path = tmp_path / "p.json"
    STRICT.replace(name="custom", min_surface_bytes=0).save(path)
    dev = get_device("emulator", str(path))
    assert dev.profile.name == "custom" and dev.profile.min_surface_bytes == 0
