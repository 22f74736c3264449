"""The real backend's rules around the private calls, against a fake framework (ane_fake.py).

The fake behaves as the decompiled framework does where the rules depend on it (unload
deletes the folder, aned keeps programs by hash), so these run on Linux: folder re-creation,
budget accounting, unload marking, request reuse, one copy of the weights, releases.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from anelm.device import ane, ane_framework, objc
from anelm.device.base import Surface, compile_count, reset_compile_count
from anelm.chip.profile import STRICT
from anelm.errors import CompileBudgetExceeded, DeviceError

from ane_fake import Aned, FakeFramework

PATH = "@model_path/weights/w.bin"


@pytest.fixture
def fake(tmp_path):
    return FakeFramework(tmp_path)


def device(fake, budget=10**6):
    return ane.AneDevice(STRICT.replace(compile_budget=budget), framework=fake)


def prog(i: int = 0) -> str:
    return ane.SELF_TEST_MIL.replace("fp16(0.5)", f"fp16({0.5 + i})")


def test_unload_deletes_the_folder_and_the_next_load_recreates_it(fake):
    dev = device(fake)
    m = dev.compile(ane.SELF_TEST_MIL, {PATH: b"\x01\x02"})
    dev.load(m)
    dev.unload(m)
    assert not m.folder.exists()  # the framework's unload removed it
    dev.load(m)  # the fake refuses a load without model.mil: it was re-created
    assert (m.folder / "model.mil").read_text() == ane.SELF_TEST_MIL and m.loaded
    dev.self_test()  # compile, load, evaluate and check through the seam


def test_another_models_unload_cannot_break_a_shared_folder(fake):
    dev = device(fake)
    a, b = dev.compile(prog(), {}), dev.compile(prog(), {})
    assert a.folder == b.folder  # same content, same hex id, same folder
    dev.load(a)
    dev.load(b)
    dev.unload(a)  # deletes the folder b was loaded from
    dev.unload(b)
    dev.load(b)
    a.release()
    assert b.folder.exists()  # our release leaves a folder another live model uses
    b.release()
    assert not b.folder.exists()


def test_rewrite_after_unload_reaches_the_next_load(fake):
    dev = device(fake)
    m = dev.compile(prog(), {PATH: b"old"})
    dev.load(m)
    dev.unload(m)
    dev.rewrite_weight(m, PATH, b"new")  # the folder is gone: this used to raise
    dev.load(m)
    assert fake.models[m.ptr]["loaded_blobs"] == {PATH: b"new"}  # not put back to "old" by the re-creation
    with pytest.raises(DeviceError, match="not a blob of this model"):
        dev.rewrite_weight(m, "@model_path/weights/other.bin", b"x")


def test_a_failed_unload_leaves_the_model_loaded_and_is_retried(fake):
    dev = device(fake)
    m = dev.compile(prog(), {})
    dev.load(m)
    fake.fail_unloads = 1
    with pytest.raises(DeviceError, match="unloadWithQoS failed"):
        dev.unload(m)
    assert m.loaded and fake.models[m.ptr]["loaded"]
    dev.unload(m)  # tried again, not skipped
    assert not m.loaded and not fake.models[m.ptr]["loaded"]
    assert [c for c, _ in fake.calls].count("unload") == 2


def test_only_cold_compiles_count_and_aned_is_asked_first(tmp_path):
    aned = Aned()
    first = FakeFramework(tmp_path / "p1", aned)
    dev = device(first)
    m = dev.compile(prog(1), {})
    assert m.compiled and compile_count() == 1
    assert [c for c, _ in first.calls] == ["compiledModelExists", "compile"]
    dev.compile(prog(1), {})  # this process again: aned has it now
    assert compile_count() == 1
    reset_compile_count()  # a second process, same aned
    second = FakeFramework(tmp_path / "p2", aned)
    dev2 = device(second)
    m2 = dev2.compile(prog(1), {})
    assert not m2.compiled and compile_count() == 0 and ("compile", m2.hex_id) not in second.calls
    dev2.load(m2)  # served by aned, from a folder written for it


def test_the_budget_stops_cold_compiles_but_not_cached_programs(fake):
    dev = device(fake, budget=2)
    dev.compile(prog(1), {})
    fake.fail_compiles = 1
    with pytest.raises(DeviceError, match="compile failed"):
        dev.compile(prog(2), {})  # a failed cold compile still spends one (the leak is per call)
    assert compile_count() == 2
    with pytest.raises(CompileBudgetExceeded):
        dev.compile(prog(3), {})
    dev.compile(prog(1), {})  # aned holds it: a load, not a compile
    assert compile_count() == 2


def test_a_request_is_built_once_per_surface_set(fake):
    dev = device(fake)
    m = dev.compile(ane.SELF_TEST_MIL, {})
    dev.load(m)
    x = np.linspace(-1, 1, 64 * 384).astype(np.float16)
    a, b, c = (dev.new_surface(x.nbytes) for _ in range(3))
    a.write(x)
    for _ in range(3):
        dev.evaluate(m, [a], [b])
    assert fake.requests_made == 1
    dev.evaluate(m, [a], [c])
    assert fake.requests_made == 2
    np.testing.assert_array_equal(c.read(x.nbytes).view(np.float16), x + np.float16(0.5))
    c.release()
    c2 = dev.new_surface(x.nbytes)
    dev.evaluate(m, [a], [c2])
    assert fake.requests_made == 3
    with pytest.raises(DeviceError, match="only surfaces from AneDevice.new_surface"):
        dev.evaluate(m, [Surface(16)], [b])


def test_close_releases_every_object_exactly_once(fake):
    dev = device(fake)
    for i in range(3):
        m = dev.compile(prog(i), {})
        dev.load(m)
        s = dev.new_surface(49152)
        dev.evaluate(m, [s], [s])
    fake.fail_compiles = 1
    with pytest.raises(DeviceError):
        dev.compile(prog(8), {})
    dev.close()
    assert fake.live == {}  # the fake asserts on any double release


def test_the_weights_are_the_callers_own_objects(fake):
    dev = device(fake)
    blob = np.arange(4096, dtype=np.uint8).tobytes()
    m = dev.compile(prog(), {PATH: blob})
    assert fake.received_weights[-1][PATH] is blob and m.weights[PATH] is blob  # referenced, not copied
    assert not hasattr(m, "_descriptor")


# ----------------------------------------------------------------------------- the real seam


class RecordingRuntime:
    """Stands in for objc.Runtime under ane_framework.Framework: records each message."""

    data_no_copy = objc.Runtime.data_no_copy  # the real method, over these recorded sends

    def __init__(self):
        self.sent, self.retained, self._next = [], [], 0x5000

    def _obj(self) -> int:
        self._next += 8
        return self._next

    def send(self, target, selector, restype, argtypes, *args):
        self.sent.append((selector, args))
        return "hex" if selector == "hexStringIdentifier" else self._obj()

    def cls(self, name):
        return 1

    def ns(self, value):
        return value if isinstance(value, objc.Id) else self._obj()

    def string(self, obj):
        return "0123_abcd_ef"

    def retain(self, obj):
        self.retained.append(obj)
        return obj

    @contextlib.contextmanager
    def pool(self):
        yield


def test_new_model_keeps_only_the_model_and_passes_blobs_without_copies():
    fw = ane_framework.Framework.__new__(ane_framework.Framework)
    fw.rt, fw.classes = RecordingRuntime(), {name: 1 for name in ane_framework.CLASSES}
    blobs = {PATH: np.arange(256, dtype=np.uint8).tobytes(), "@model_path/weights/v.bin": bytearray(b"\x07" * 99)}
    mil = b"program(1.3)"
    model, hex_id = fw.new_model(mil, blobs)
    assert hex_id == "0123_abcd_ef"
    model_sends = [s for s, _ in fw.rt.sent if s == "inMemoryModelWithDescriptor:"]
    assert fw.rt.retained == [model] and len(model_sends) == 1  # the descriptor is never retained
    no_copy = [args for s, args in fw.rt.sent if s == "dataWithBytesNoCopy:length:freeWhenDone:"]
    want = [objc.buffer_address(b) for b in (*blobs.values(), mil)]
    assert sorted((a, n) for a, n, _ in no_copy) == sorted(want)  # the callers' own memory
    assert all(free is False for *_, free in no_copy)
    assert not any(s == "dataWithBytes:length:" for s, _ in fw.rt.sent)


def test_buffer_address_is_the_buffers_own_memory():
    import ctypes

    b = b"\x01\x02\x03"
    assert objc.buffer_address(b) == (ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value, 3)
    arr = bytearray(10)
    assert objc.buffer_address(arr)[0] == ctypes.addressof((ctypes.c_char * 10).from_buffer(arr))
    assert objc.buffer_address(b"") == (0, 0)


def test_iosurface_lock_failure_is_one_readable_line():
    rt = objc.Runtime.__new__(objc.Runtime)

    class Lib:
        @staticmethod
        def IOSurfaceLock(ref, options, seed):  # noqa: N802 - the C name
            return -536870212  # kIOReturnError, as a signed kern_return_t

    rt.iosurface = Lib()
    with pytest.raises(DeviceError) as e:
        with rt.iosurface_locked(0x10, 0):
            pass
    assert str(e.value) == "IOSurfaceLock failed: kern_return_t 0xe00002bc"
