"""The real ANE backend.

Two halves. Everywhere: importing the backend loads nothing, `available()` says why not,
the compile-folder layout, and a static check that every Objective-C message send names a
prototype whose argument count matches its selector. On Apple Silicon only (`-m ane`): the
binding itself, on the chip. No test pretends to be the hardware.
"""

from __future__ import annotations

import ast
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anelm.device import ane
from anelm.device.ane import objc
from anelm.chip.profile import STRICT
from anelm.errors import DeviceError

ON_APPLE_SILICON = platform.system() == "Darwin" and platform.machine() == "arm64"
SRC = Path(ane.__file__).parent


# ----------------------------------------------------------------------------- everywhere


def test_import_loads_nothing():
    # a fresh interpreter: record every dlopen ctypes makes while the backend is imported
    code = """
import ctypes, json, os, sys
import numpy, anelm.device.base
import platform, shutil, subprocess, tempfile, threading, weakref, collections, hashlib  # stdlib the backend uses: part of the baseline
opened = []
_init = ctypes.CDLL.__init__
def spy(self, name, *a, **k):
    opened.append(str(name))
    _init(self, name, *a, **k)
ctypes.CDLL.__init__ = spy
maps = lambda: {l.split()[-1] for l in open('/proc/self/maps') if '.so' in l} if os.path.exists('/proc/self/maps') else set()
before = maps()
import anelm.device.ane as ane, anelm.device.ane.objc as objc, anelm.device.machine, anelm.device.ane.selftest
print(json.dumps({"opened": opened, "new_libs": sorted(maps() - before), "loaded": objc.loaded(),
                  "framework": ane.ane_framework.loaded()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    state = json.loads(out.stdout)
    assert state == {"opened": [], "new_libs": [], "loaded": False, "framework": False}


@pytest.mark.skipif(ON_APPLE_SILICON, reason="checks the answer off Apple Silicon")
def test_available_is_false_with_a_reason_and_still_loads_nothing():
    ok, reason = ane.available()
    assert ok is False
    assert ("not macOS" in reason) or ("not Apple Silicon" in reason)
    assert not objc.loaded()


def test_available_names_each_missing_piece(tmp_path):
    assert ane.available(system="Linux", machine="x86_64") == (False, "not macOS (this is Linux)")
    ok, reason = ane.available(system="Darwin", machine="x86_64")
    assert not ok and "Rosetta" in reason
    ok, reason = ane.available(system="Darwin", machine="arm64", framework_dir=str(tmp_path / "missing"))
    assert not ok and "missing" in reason


@pytest.mark.skipif(ON_APPLE_SILICON, reason="checks the refusal off Apple Silicon")
def test_device_refuses_to_start_off_apple_silicon():
    with pytest.raises(DeviceError, match="unavailable"):
        ane.AneDevice(STRICT)
    if sys.platform != "darwin":
        with pytest.raises(DeviceError, match="needs macOS"):
            objc.runtime()


def test_compile_folder_layout(tmp_path):
    folder = tmp_path / "0123abcd"
    ane.populate_folder(folder, "program(1.3)\n", {"@model_path/weights/wq.bin": b"\x01\x02",
                                                   "@model_path/layer0/mask.bin": b"\x03"})
    assert (folder / "model.mil").read_text() == "program(1.3)\n"
    assert (folder / "weights" / "wq.bin").read_bytes() == b"\x01\x02"
    assert (folder / "layer0" / "mask.bin").read_bytes() == b"\x03"
    for bad in ("weights/x.bin", "@model_path/../escape.bin", "@model_path/", "@model_path//abs.bin"):
        with pytest.raises(DeviceError):
            ane.weight_relpath(bad)


def test_shared_folder_is_deleted_by_its_last_user(tmp_path):
    folder = tmp_path / "same-hex"
    ane.populate_folder(folder, "m", {})
    ane._acquire_folder(folder)
    ane._acquire_folder(folder)  # identical MIL and keys give the same hex id (Orion's hazard)
    ane._drop_folder(folder)
    assert folder.exists()
    ane._drop_folder(folder)
    assert not folder.exists()


def _send_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "send":
            yield node


def test_every_message_send_matches_its_selector():
    # objc_msgSend is called through the prototype we give it; on arm64 a wrong argument
    # count is a silent register mix-up, so check the private table and every call site here
    for sel, (cls, _, _, argtypes) in ane.PRIVATE_CALLS.items():
        assert sel.count(":") == len(argtypes) and cls in ane.CLASSES, sel
    private_used, checked = set(), 0
    for path in (SRC / "__init__.py", SRC / "framework.py", SRC / "objc.py"):
        for call in _send_calls(path):
            if len(call.args) < 2 or not isinstance(call.args[1], ast.Constant):
                continue  # the generic definitions themselves
            sel, where = call.args[1].value, f"{path.name}:{call.lineno}"
            if len(call.args) > 3 and isinstance(call.args[3], ast.List):  # rt.send(obj, sel, restype, [argtypes], *args)
                n_types, n_args = len(call.args[3].elts), len(call.args) - 4
            else:  # fw.send(obj, sel, *args): the prototype comes from PRIVATE_CALLS
                assert sel in ane.PRIVATE_CALLS, f"{where}: private selector {sel} has no prototype"
                n_types, n_args = len(ane.PRIVATE_CALLS[sel][3]), len(call.args) - 2
                private_used.add(sel)
            assert sel.count(":") == n_types == n_args, f"{where} -{sel}"
            checked += 1
    assert private_used == set(ane.PRIVATE_CALLS)  # the table holds exactly what is sent
    assert checked >= 20


def test_objc_type_encodings_are_read_per_argument():
    # what check_prototype compares our prototypes against, e.g. -compileWithQoS:options:error:
    assert objc.encoding_tokens("B40@0:8I16@20^@28") == ["B", "@", ":", "I", "@", "^@"]
    assert objc.encoding_tokens('@32@0:8r^{__IOSurface=}16@"NSString"24') == ["@", "@", ":", "^{__IOSurface=}",
                                                                             '@"NSString"']
    assert [objc._kind(t) for t in objc.encoding_tokens("v24@0:8Q16")] == ["void", "obj", "sel", "u64"]


def test_nserror_becomes_a_device_error():
    e = objc.ObjCError("compileWithQoS", "com.apple.appleneuralengine", -3, "Program compile failed")
    assert isinstance(e, DeviceError) and e.code == -3 and e.domain == "com.apple.appleneuralengine"
    assert str(e) == "compileWithQoS failed: com.apple.appleneuralengine error -3: Program compile failed"


# ----------------------------------------------------------------------------- on the chip


@pytest.fixture
def device(fresh_compile_count):
    ok, reason = ane.available()
    if not ok:
        pytest.skip(f"needs a real Apple Neural Engine (macOS on Apple Silicon): {reason}")
    dev = ane.AneDevice(STRICT)
    yield dev
    dev.close()


@pytest.mark.ane
def test_self_test_passes(device):
    device.self_test()
    assert device.compile_count == 1


@pytest.mark.ane
def test_add_program_and_its_folder(device):
    model = device.compile(ane.SELF_TEST_MIL, {})
    assert (model.folder / "model.mil").read_text() == ane.SELF_TEST_MIL
    device.load(model)
    x = np.linspace(-2, 2, 64 * 384).astype(np.float16)
    inp, out = device.new_surface(x.nbytes), device.new_surface(x.nbytes)
    inp.write(x)
    device.evaluate(model, [inp], [out])
    got = out.read(x.nbytes).view(np.float16).astype(np.float64)
    assert np.max(np.abs(got - (x.astype(np.float64) + 0.5))) / 2.5 <= 2e-3
    device.unload(model)
    folder = model.folder
    model.release()
    assert not folder.exists()


@pytest.mark.ane
def test_binding_order_is_one_of_the_two_rules(device):
    from anelm.doctor import run_probe, select

    for probe in select(["bind."]):
        assert run_probe(probe, device).outcome in ("alphabetical", "declared"), probe.name


@pytest.mark.ane
def test_surfaces_release_deterministically(device):
    s = device.new_surface(49152)
    s.write(b"\x01" * 16)
    assert bytes(s.read(16)) == b"\x01" * 16
    s.release()
    assert s.released and s.nbytes == 0
    s.release()  # twice is harmless
    with pytest.raises(DeviceError):
        s.read(16)
    with pytest.raises(DeviceError):
        s.view()  # an IOSurface is only touched under its lock
