"""The real backend's rules around the private calls, against a fake framework (ane_fake.py).

The fake behaves as the decompiled framework does where the rules depend on it (unload
deletes the folder, aned keeps programs by hash), so these run on Linux: folder re-creation,
budget accounting, unload marking, request reuse, one copy of the weights, releases.
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from anelm.device import ane
from anelm.device.ane import framework as ane_framework
from anelm.device.ane import objc
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
    assert fake.received_weights[-1][PATH] == objc.buffer_address(blob) and m.weights[PATH] is blob  # not copied
    assert not hasattr(m, "_descriptor")


def test_the_folder_is_made_beside_and_renamed_in_never_rewritten(fake, monkeypatch):
    writes = []
    real = ane.write_model_folder
    monkeypatch.setattr(ane, "write_model_folder", lambda folder, *a: writes.append(Path(folder)) or real(folder, *a))
    dev = device(fake)
    a = dev.compile(prog(), {PATH: b"w"})
    dev.load(a)
    b = dev.compile(prog(), {PATH: b"w"})  # the same program, in the same folder: a may be loading from it
    dev.load(b)
    assert len(writes) == 1 and writes[0] != a.folder and writes[0].parent == a.folder.parent
    dev.unload(a)  # the framework deletes the folder
    a.folder.mkdir()
    (a.folder / "stray").write_text("a partial folder")  # what a crash mid-write used to leave
    dev.load(a)  # made again, whole, in one rename
    assert len(writes) == 2 and writes[1] != a.folder and not (a.folder / "stray").exists()
    assert sorted(p.name for p in a.folder.parent.iterdir() if not p.name.endswith(".lock")) == [a.hex_id]


OTHER_PROCESS = """
import sys
sys.path.insert(0, {tests!r})
from ane_fake import FakeFramework
from anelm.chip.profile import STRICT
from anelm.device import ane
model = ane.AneDevice(STRICT.replace(compile_budget=10**6), framework=FakeFramework({tmp!r})).compile({mil!r}, {{}})
print("compiled", flush=True)
sys.stdin.read()
"""


def test_a_folder_another_process_uses_survives_our_release(fake):
    dev = device(fake)
    m = dev.compile(prog(), {})
    code = OTHER_PROCESS.format(tests=str(Path(__file__).parent), tmp=str(fake.tmp), mil=prog())
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "compiled\n"
        m.release()
        assert m.folder.exists()  # the other process's model still uses it
    finally:
        other.stdin.close()
        other.wait(60)
    last = dev.compile(prog(), {})
    last.release()  # now the only user
    assert not last.folder.exists()


def test_a_load_that_fails_twice_recompiles_and_charges_the_budget(tmp_path):
    aned = Aned()
    first = device(FakeFramework(tmp_path / "p1", aned))
    for i in (1, 2):
        first.compile(prog(i), {})
    reset_compile_count()  # a second process, same aned
    fw = FakeFramework(tmp_path / "p2", aned)
    dev = device(fw, budget=1)
    m, m2 = dev.compile(prog(1), {}), dev.compile(prog(2), {})
    assert not m.compiled and not m2.compiled and compile_count() == 0  # aned said it holds both
    aned.programs.clear()  # and then dropped them
    dev.load(m)
    assert m.loaded and m.compiled and compile_count() == 1
    assert [c for c, h in fw.calls if h == m.hex_id] == ["compiledModelExists", "load", "load", "compile", "load"]
    with pytest.raises(CompileBudgetExceeded):
        dev.load(m2)  # a recompile is a cold compile: past the budget, refused
    assert not m2.loaded
    fw.fail_loads = 1
    dev.unload(m)
    dev.load(m)  # a load that works on its retry compiles nothing
    assert compile_count() == 1


def test_a_superseded_no_copy_blob_lives_until_the_release(fake):
    dev = device(fake)
    blob = np.arange(4096, dtype=np.uint8)  # the framework's NSData points at this memory, holding no reference
    alive = weakref.ref(blob)
    m = dev.compile(prog(), {PATH: blob})
    del blob
    dev.rewrite_weight(m, PATH, b"new")
    dev.rewrite_weight(m, PATH, b"newer")
    gc.collect()
    assert alive() is not None and list(m.superseded) == [PATH]  # the original only, not each rewrite
    m.release()
    gc.collect()
    assert alive() is None


def test_threads_share_a_models_request_cache(fake):
    dev = device(fake)
    m = dev.compile(ane.SELF_TEST_MIL, {})
    dev.load(m)
    a, b = dev.new_surface(49152), dev.new_surface(49152)
    both_inside = threading.Barrier(2, timeout=0.5)  # passes only if two threads build at once
    real = fake.new_request

    def slow_request(inputs, outputs):
        with contextlib.suppress(threading.BrokenBarrierError):
            both_inside.wait()
        return real(inputs, outputs)

    fake.new_request = slow_request
    threads = [threading.Thread(target=dev.evaluate, args=(m, [a], [b])) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.requests_made == 1
    dev.close()
    assert fake.live == {}  # no request was built twice and lost


# ----------------------------------------------------------------------------- the real seam


class RecordingRuntime:
    """Stands in for objc.Runtime under ane.framework.Framework: records each message."""

    data_no_copy = objc.Runtime.data_no_copy  # the real method, over these recorded sends

    def __init__(self, answers: dict | None = None):
        self.sent, self.retained, self._next = [], [], 0x5000
        self.answers = answers or {}  # selector -> what the send returns

    def _obj(self) -> int:
        self._next += 8
        return self._next

    def send(self, target, selector, restype, argtypes, *args):
        self.sent.append((selector, args))
        return self.answers[selector] if selector in self.answers else self._obj()

    def cls(self, name):
        return 1

    def sel(self, name):
        return name

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


def recording_framework(**answers) -> ane_framework.Framework:
    fw = ane_framework.Framework.__new__(ane_framework.Framework)
    fw.rt, fw.classes = RecordingRuntime(answers), {name: 1 for name in ane_framework.CLASSES}
    return fw


def test_compiled_model_exists_is_probed_before_it_is_sent():
    fw = recording_framework(**{"respondsToSelector:": False})
    assert fw.compiled_model_exists(0x10) is False and fw.compiled_model_exists(0x10) is False
    assert [s for s, _ in fw.rt.sent] == ["respondsToSelector:"]  # asked once; never sent: that would abort us
    fw = recording_framework(**{"respondsToSelector:": True, "compiledModelExists": True})
    assert fw.compiled_model_exists(0x10) is True
    assert fw.rt.sent == [("respondsToSelector:", ("compiledModelExists",)), ("compiledModelExists", ())]


def test_a_framework_without_compiled_model_exists_still_loads():
    class Runtime:
        gone = {"compiledModelExists"}

        def check_prototype(self, cls, is_cls, sel, restype, argtypes):
            if sel in self.gone:
                raise DeviceError(f"-[{cls} {sel}] is gone: this macOS changed the private API")

    rt = Runtime()
    assert ane_framework.check_calls(rt) == ["-[_ANEInMemoryModel compiledModelExists] is gone: this macOS "
                                             "changed the private API; every program will be compiled cold"]
    rt.gone = {"loadWithQoS:options:error:"}
    with pytest.raises(DeviceError, match="loadWithQoS"):
        ane_framework.check_calls(rt)


class PoolRuntime(objc.Runtime):
    """The generic half of objc.Runtime over recorded sends: tracks the autorelease pool depth."""

    def __init__(self):
        self.depth, self.sent = 0, []

    def cls(self, name):
        return 1

    def send(self, receiver, selector, restype, argtypes, *args):
        self.depth += {"init": 1, "drain": -1}.get(selector, 0)  # alloc + init makes a pool
        self.sent.append((selector, args, self.depth))
        return 0x77

    def string(self, ns):
        self.sent.append(("UTF8String", (), self.depth))
        return "/private/var/folders/x/T/"


def test_numpy_numbers_box_as_python_ones():
    rt = PoolRuntime()
    for value in (np.int64(49152), np.uint32(7), np.bool_(True)):  # sizes from np.prod, flags from numpy
        rt.ns(value)
    sent = [(s, args) for s, args, _ in rt.sent]
    assert sent == [("numberWithLongLong:", (49152,)), ("numberWithLongLong:", (7,)), ("numberWithBool:", (True,))]
    assert all(type(a) in (int, bool) for _, args in sent for a in args)


def test_the_temporary_directory_is_read_inside_a_pool():
    rt = PoolRuntime()

    class Foundation:
        @staticmethod
        def NSTemporaryDirectory():  # noqa: N802 - the C name
            rt.sent.append(("NSTemporaryDirectory", (), rt.depth))
            return 0x99

    rt.foundation = Foundation()
    assert rt.temporary_directory() == "/private/var/folders/x/T/"
    depths = {s: d for s, _, d in rt.sent}
    assert depths["NSTemporaryDirectory"] == depths["UTF8String"] == 1 and rt.depth == 0


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
