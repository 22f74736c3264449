"""`--device auto` runs the ANE self-test in a child process and caches the verdict.

On Linux the child is pointed at a stand-in that crashes (SIGSEGV through ctypes, or a
signal) or answers as a passing self-test does; the parent must survive, fall back with one
notice, and read the cached verdict the next time without starting a child.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from anelm.cli.main import main
from anelm import caches
from anelm.device import ane
from anelm.device.ane import selftest
from anelm.device.emulator import Emulator
from anelm.device.select import get_device
from anelm.device import isolate
from anelm.doctor import Isolated

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


def test_a_failure_is_replayed_for_minutes_only(mac):
    child, children = mac
    child(SEGFAULT)
    assert selftest.verdict()[0] is False
    path = selftest.verdict_path()
    record = json.loads(path.read_text())
    record["at"] = time.time() - 600  # ten minutes ago: aned may have been busy after boot
    path.write_text(json.dumps(record))
    child(PASSES)
    assert selftest.verdict() == (True, "the backend passed its self-test") and len(children) == 2
    child("raise SystemExit('a pass is kept: no child')")
    assert selftest.verdict()[0] is True and len(children) == 2


def test_an_edit_to_anelm_tests_again(mac, monkeypatch):
    child, children = mac
    child(SEGFAULT)
    assert selftest.verdict()[0] is False
    monkeypatch.setattr(caches, "source_fingerprint", lambda: "the sources after a fix")
    child(PASSES)
    assert selftest.verdict() == (True, "the backend passed its self-test") and len(children) == 2


def test_doctor_records_the_self_test_it_ran(mac, monkeypatch, capsys):
    child, children = mac
    child(SEGFAULT)
    assert selftest.verdict()[0] is False  # a failure cached by an earlier `--device auto`
    monkeypatch.setattr("anelm.doctor.run_isolated", lambda *a, **k: Isolated(self_test=""))  # it passes now
    assert main(["doctor", "--probe", "op.add", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"]["name"] == "ane"
    child("raise SystemExit('the doctor measured it: no child')")
    assert selftest.verdict() == (True, "the backend passed its self-test") and len(children) == 1


def test_a_child_that_hangs_at_exit_is_killed_and_its_answer_stands(mac, monkeypatch):
    child, _ = mac
    child(PASSES + "; import time; time.sleep(120)")  # answers, then never exits
    monkeypatch.setattr(isolate, "EXIT_WAIT_S", 0.5, raising=False)
    assert selftest.run_in_child() == (True, "the backend passed its self-test")
