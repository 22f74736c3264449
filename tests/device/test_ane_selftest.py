"""`--device auto` runs the ANE self-test in a child process and caches the verdict.

On Linux the child is pointed at a stand-in that crashes (SIGSEGV through ctypes, or a
signal) or answers as a passing self-test does; the parent must survive, fall back with one
notice, and read the cached verdict the next time without starting a child.
"""

from __future__ import annotations

import json
import sys

import pytest

from anelm.device import ane, selftest
from anelm.device.emulator import Emulator
from anelm.device.select import get_device
from anelm.device import isolate

from ane_fake import FakeFramework

SEGFAULT = "import ctypes; ctypes.string_at(0)"  # a NULL read: SIGSEGV, as a bad private call gives
PASSES = f"print({isolate.MARK!r} + '{json.dumps({'event': 'self_test', 'error': ''})}'); " \
         f"print({isolate.MARK!r} + '{json.dumps({'event': 'done'})}')"


@pytest.fixture
def mac(monkeypatch, tmp_path):
    """A machine whose backend loads (available() says yes), with its own cache dir."""
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ane, "available", lambda: (True, "stand-in framework"))
    children = []

    def child(code):
        def argv():
            children.append(code)
            return [sys.executable, "-c", code]
        monkeypatch.setattr(isolate, "child_argv", argv)
    return child, children


def test_a_crashing_self_test_leaves_the_parent_on_the_emulator(mac, capsys):
    child, children = mac
    child(SEGFAULT)
    dev = get_device("auto")
    assert isinstance(dev, Emulator) and len(children) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("anelm: device: emulator (no Apple Neural Engine: ")
    assert "crashed its process" in err and "SIGSEGV" in err
    assert selftest.verdict_path().is_file()

    child("raise SystemExit('a second child must not start')")
    assert isinstance(get_device("auto"), Emulator) and len(children) == 1  # the cached verdict
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SIGSEGV" in err and "verdict cached in" in err


def test_a_killed_child_and_an_explicit_ane_request(mac, capsys):
    child, _ = mac
    child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(Exception, match="unavailable: the self-test crashed its process .*SIGKILL"):
        get_device("ane")


def test_a_passing_self_test_gives_the_ane(mac, monkeypatch, tmp_path, capsys):
    child, children = mac
    child(PASSES)
    real = ane.AneDevice
    monkeypatch.setattr(ane, "AneDevice", lambda p: real(p, framework=FakeFramework(tmp_path)))
    dev = get_device("auto")
    assert dev.name == "ane" and dev.compile_count == 0  # the self-test compiled in the child
    assert capsys.readouterr().err == "anelm: device: ane\n"
    assert isinstance(get_device("auto"), real) and len(children) == 1


def test_the_verdict_is_per_os_build(mac, monkeypatch):
    child, children = mac
    child(SEGFAULT)
    assert selftest.verdict()[0] is False
    build = selftest.identity()
    monkeypatch.setattr(selftest, "identity", lambda: {**build, "os_build": "Darwin Kernel Version 99"})
    child(PASSES)
    assert selftest.verdict() == (True, "the backend passed its self-test") and len(children) == 2
