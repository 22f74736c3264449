"""get_device: auto falls back to the emulator with a reason; ane on request or a one-line error.

The real backend is replaced by fake `anelm.device.ane` modules so every branch runs on any OS.
"""

import sys
import types

import pytest

import anelm.device
from anelm.device.emulator import Emulator
from anelm.device.profile import STRICT
from anelm.device.select import get_device
from anelm.errors import DeviceError, UsageError


class FakeAne:
    name = "ane"

    def __init__(self, profile):
        self.profile = profile

    def self_test(self):
        pass


def install(monkeypatch, available=(True, ""), self_test_error=None, module=True):
    """Put a fake backend (or, with module=False, an unimportable one) in place."""
    monkeypatch.delattr(anelm.device, "ane", raising=False)
    if not module:
        monkeypatch.setitem(sys.modules, "anelm.device.ane", None)  # import now raises ImportError
        return
    fake = types.ModuleType("anelm.device.ane")

    class Dev(FakeAne):
        def self_test(self):
            if self_test_error:
                raise self_test_error
    fake.available = lambda: available
    fake.AneDevice = Dev
    monkeypatch.setitem(sys.modules, "anelm.device.ane", fake)
    monkeypatch.setattr(anelm.device, "ane", fake, raising=False)


def test_emulator_on_request(capsys):
    dev = get_device("emulator")
    assert isinstance(dev, Emulator) and dev.profile is STRICT
    assert capsys.readouterr().err == "anelm: device: emulator (requested)\n"


def test_auto_without_ane_uses_emulator_with_reason(monkeypatch, capsys):
    install(monkeypatch, available=(False, "not macOS on Apple Silicon (linux)"))
    assert isinstance(get_device("auto"), Emulator)
    assert capsys.readouterr().err == \
        "anelm: device: emulator (no Apple Neural Engine: not macOS on Apple Silicon (linux))\n"


def test_auto_when_backend_does_not_import(monkeypatch, capsys):
    install(monkeypatch, module=False)
    assert isinstance(get_device(), Emulator)
    err = capsys.readouterr().err
    assert err.startswith("anelm: device: emulator (no Apple Neural Engine: backend did not import") and err.count("\n") == 1


def test_auto_when_self_test_fails(monkeypatch, capsys):
    install(monkeypatch, self_test_error=DeviceError("self-test output mismatch\nsecond line"))
    assert isinstance(get_device("auto"), Emulator)
    assert capsys.readouterr().err == \
        "anelm: device: emulator (no Apple Neural Engine: DeviceError: self-test output mismatch)\n"


def test_auto_uses_working_ane(monkeypatch, capsys):
    install(monkeypatch)
    prof = STRICT.replace(name="m4")
    dev = get_device("auto", prof)
    assert isinstance(dev, FakeAne) and dev.profile is prof
    assert capsys.readouterr().err == "anelm: device: ane\n"


def test_ane_requested_but_unavailable_is_one_line_error(monkeypatch):
    install(monkeypatch, available=(False, "no AppleNeuralEngine.framework"))
    with pytest.raises(DeviceError, match=r"^--device ane requested but the Apple Neural Engine is unavailable: "
                                          r"no AppleNeuralEngine.framework$"):
        get_device("ane")


def test_bad_name_and_profile_by_path(tmp_path, capsys):
    with pytest.raises(UsageError, match="expected one of auto, ane, emulator"):
        get_device("gpu")
    path = tmp_path / "p.json"
    STRICT.replace(name="custom", min_surface_bytes=0).save(path)
    dev = get_device("emulator", str(path))
    assert dev.profile.name == "custom" and dev.profile.min_surface_bytes == 0
