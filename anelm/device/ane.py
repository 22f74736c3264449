"""The real Apple Neural Engine: Apple's private in-memory MIL API, called through ctypes.

The only module that talks to AppleNeuralEngine.framework, kept thin: one method per
life-cycle step (compile, load, evaluate, unload), each private call commented with the
fact it relies on; docs/ane-backend.md lists them in order with where each fact comes from.
Importing this module loads nothing; `available()` and `AneDevice()` do, on macOS/arm64.
`anelm doctor` and tests/device/test_ane_binding.py check it on the user's Mac.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import threading
import time
import weakref
from ctypes import byref, c_uint, c_void_p
from pathlib import Path

import numpy as np

from ..errors import DeviceError
from . import objc
from .base import Device, Surface, charge_compile
from .objc import BOOL, ERROR_OUT, ID, Id
from .overflow import output_overflow
from .profile import STRICT, ChipProfile

FRAMEWORK_DIR = "/System/Library/PrivateFrameworks/AppleNeuralEngine.framework"
FRAMEWORK = f"{FRAMEWORK_DIR}/AppleNeuralEngine"
CLASSES = ("_ANEInMemoryModelDescriptor", "_ANEInMemoryModel", "_ANERequest", "_ANEIOSurfaceObject")
QOS = 21  # every reference passes 21 (the M5 sweep found 0-63 all work; 0 loads slowly)
LOAD_RETRY_DELAY_S = 0.1  # maderix's bridge retries a failed load once after 100 ms
MODEL_PATH = "@model_path/"  # weight keys name files relative to the compile folder

# ----------------------------------------------------------------------------- availability


def available(system: str | None = None, machine: str | None = None,
              framework_dir: str = FRAMEWORK_DIR) -> tuple[bool, str]:
    """Whether the real backend can start here, and why (not). Loads the framework on macOS/arm64."""
    system = system or platform.system()
    machine = machine or platform.machine()
    if system != "Darwin":
        return False, f"not macOS (this is {system})"
    if machine != "arm64":
        return False, f"not Apple Silicon: this Python runs as {machine} (an Intel Mac, or Rosetta)"
    if not os.path.isdir(framework_dir):
        return False, f"{framework_dir} is missing (the MIL path needs macOS on M1 or later)"
    try:
        fw = _framework()
    except Exception as e:  # noqa: BLE001 - whatever a load fails with is the reason, never a crash
        return False, str(e) if isinstance(e, DeviceError) else f"{type(e).__name__}: {e}"
    why = "AppleNeuralEngine.framework loaded; its four classes and nine selectors resolved"
    return True, why + (f"; prototype warnings (the self-test decides): {'; '.join(fw.warnings)}" if fw.warnings else "")


# Every private message we send, with the exact prototype it is sent through (facts:
# maderix-ane-facts §1.2, orion-facts §3.1). Checked against the runtime when the framework
# loads: a missing selector makes the backend unavailable instead of aborting the process.
PRIVATE_CALLS = {  # selector: (class, class method?, restype, argtypes)
    "modelWithMILText:weights:optionsPlist:": ("_ANEInMemoryModelDescriptor", True, ID, [ID, ID, ID]),
    "inMemoryModelWithDescriptor:": ("_ANEInMemoryModel", True, ID, [ID]),
    "hexStringIdentifier": ("_ANEInMemoryModel", False, ID, []),
    "compileWithQoS:options:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ID, ERROR_OUT]),
    "loadWithQoS:options:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ID, ERROR_OUT]),
    "evaluateWithQoS:options:request:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ID, ID, ERROR_OUT]),
    "unloadWithQoS:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ERROR_OUT]),
    "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:":
        ("_ANERequest", True, ID, [ID, ID, ID, ID, ID, ID, ID]),
    "objectWithIOSurface:": ("_ANEIOSurfaceObject", True, ID, [c_void_p]),
}


class _Framework:
    """The loaded framework: the ObjC runtime, the four private classes, the checked prototypes."""

    def __init__(self):
        self.rt = objc.runtime()
        try:
            # Fact: the references dlopen this exact path with RTLD_NOW before looking classes up.
            self.lib = ctypes.CDLL(FRAMEWORK, mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise DeviceError(f"cannot load {FRAMEWORK}: {e}") from None
        # Fact: all four classes are required (Orion's init refuses to start without one).
        self.classes = {name: self.rt.cls(name) for name in CLASSES}
        self.warnings = [w for sel, (cls, is_cls, res, args) in PRIVATE_CALLS.items()
                         if (w := self.rt.check_prototype(cls, is_cls, sel, res, args))]

    def send(self, receiver, selector: str, *args):
        """A private message, through the prototype PRIVATE_CALLS gives it."""
        cls, is_class, restype, argtypes = PRIVATE_CALLS[selector]
        target = self.classes[cls] if is_class else receiver
        return self.rt.send(target, selector, restype, argtypes, *args)


_fw: _Framework | None = None
_fw_lock = threading.Lock()


def _framework() -> _Framework:
    global _fw
    with _fw_lock:
        if _fw is None:
            _fw = _Framework()
        return _fw


# ----------------------------------------------------------------------------- compile folder
# Orion's hazard: identical MIL with identical weight keys gets the same hex id and so the
# same folder; count users so that releasing one model never deletes another's files.
_folder_users: dict[str, int] = {}
_folder_lock = threading.Lock()


def weight_relpath(key: str) -> str:
    """`@model_path/weights/wq.bin` → `weights/wq.bin`, refusing paths that leave the folder."""
    if not key.startswith(MODEL_PATH):
        raise DeviceError(f"weight key '{key}' must start with '{MODEL_PATH}'")
    rel = key[len(MODEL_PATH):]
    if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise DeviceError(f"weight key '{key}' must name a file inside the compile folder")
    return rel


def populate_folder(folder: Path, mil_text: str, weights: dict[str, bytes]) -> None:
    """Fact: every reference pre-populates NSTemporaryDirectory()/<hex>/ before compiling,
    with model.mil, a weights/ folder, and each blob at its key minus "@model_path/"."""
    (folder / "weights").mkdir(parents=True, exist_ok=True)
    (folder / "model.mil").write_bytes(mil_text.encode("utf-8"))
    for key, blob in weights.items():
        path = folder / weight_relpath(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(blob))


def _acquire_folder(folder: Path) -> None:
    with _folder_lock:
        _folder_users[str(folder)] = _folder_users.get(str(folder), 0) + 1


def _drop_folder(folder: Path) -> None:
    with _folder_lock:
        n = _folder_users.pop(str(folder), 1) - 1
        if n > 0:
            _folder_users[str(folder)] = n
    if n <= 0:
        shutil.rmtree(folder, ignore_errors=True)


class AneModel:
    """A compiled program: the retained `_ANEInMemoryModel`, its descriptor and its folder.

    `unload` keeps the folder so a later `load` works (the reload experiment); `release()`
    (also on `device.close()` or when the handle is dropped) frees the objects and the folder.
    """

    def __init__(self, fw: _Framework, ptr: int, descriptor: int, hex_id: str, folder: Path, mil_text: str = ""):
        self._fw, self.ptr, self._descriptor, self.hex_id, self.folder = fw, ptr, descriptor, hex_id, folder
        self.loaded, self.mil_text = False, mil_text  # the text names the outputs for the §8 check

    @property
    def released(self) -> bool:
        return self.ptr is None

    def release(self) -> None:
        if self.ptr is None:
            return
        ptr, self.ptr, was_loaded, self.loaded = self.ptr, None, self.loaded, False
        try:
            if was_loaded:
                _unload(self._fw, ptr)
        finally:
            self._fw.rt.release(ptr)
            self._fw.rt.release(self._descriptor)
            _drop_folder(self.folder)

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the runtime may already be gone
            pass


class IOSurfaceBacked(objc.IOSurfaceBuffer, Surface):
    """A flat IOSurface, locked for every read and write; `release()` CFReleases it at once."""

    def __init__(self, fw: _Framework, nbytes: int):
        # Fact: both references create flat byte surfaces with exactly these six properties.
        props = {"kIOSurfaceWidth": nbytes, "kIOSurfaceHeight": 1, "kIOSurfaceBytesPerElement": 1,
                 "kIOSurfaceBytesPerRow": nbytes, "kIOSurfaceAllocSize": nbytes, "kIOSurfacePixelFormat": 0}
        super().__init__(fw.rt, nbytes, props)
        self._fw, self._wrap = fw, None

    def view(self) -> np.ndarray:
        raise DeviceError("an IOSurface must be locked to touch; use read() and write()")

    def ane_object(self) -> int:
        """The retained `_ANEIOSurfaceObject` wrapping this surface, made on first use."""
        if self.released:
            raise DeviceError("surface was released; allocate a new one with device.new_surface()")
        if self._wrap is None:
            rt = self._fw.rt
            with rt.pool():
                # Fact: requests take surfaces wrapped by +[_ANEIOSurfaceObject objectWithIOSurface:].
                obj = self._fw.send(None, "objectWithIOSurface:", self.ref)
                if not obj:
                    raise DeviceError("_ANEIOSurfaceObject objectWithIOSurface: returned nil")
                self._wrap = rt.retain(obj)
        return self._wrap

    def release(self) -> None:
        wrap, self._wrap = getattr(self, "_wrap", None), None
        if wrap:
            self._fw.rt.release(wrap)
        super().release()


def _unload(fw: _Framework, ptr: int) -> None:
    rt = fw.rt
    with rt.pool():
        err = rt.error_out()
        # Fact: -unloadWithQoS:error: takes the QoS and an NSError** (no options argument).
        if not fw.send(ptr, "unloadWithQoS:error:", QOS, byref(err)):
            raise rt.error_from("unloadWithQoS", err)


SELF_TEST_MIL = """program(1.3)
[buildInfo = dict<string, string>({{"coremlc-component-MIL", "3510.2.1"}, {"coremlc-version", "3505.4.1"}, \
{"coremltools-component-milinternal", ""}, {"coremltools-version", "9.0"}})]
{
    func main<ios18>(tensor<fp16, [1, 64, 1, 384]> x) {
        fp16 half = const()[name = string("half"), val = fp16(0.5)];
        tensor<fp16, [1, 64, 1, 384]> y = add(x = x, y = half)[name = string("y")];
    } -> (y);
}
"""


class AneDevice(Device):
    """The real ANE behind the Device interface; raises DeviceError where it cannot run."""

    name = "ane"

    def __init__(self, profile: ChipProfile = STRICT):
        super().__init__(profile)
        ok, why = available()
        if not ok:
            raise DeviceError(f"the ANE backend is unavailable: {why}")
        self._fw = _framework()
        self._models, self._surfaces = weakref.WeakSet(), weakref.WeakSet()  # released on close()

    def new_surface(self, nbytes: int) -> IOSurfaceBacked:
        s = IOSurfaceBacked(self._fw, nbytes)
        self._surfaces.add(s)
        return s

    def compile(self, mil_text: str, weights: dict[str, bytes]) -> AneModel:
        rt = self._fw.rt
        for key in weights:
            weight_relpath(key)  # refuse bad keys before any private call
        with rt.pool():
            desc, model = self._describe(mil_text, weights)
            # Fact: -hexStringIdentifier names the compile folder; it depends on the content.
            hex_id = rt.string(self._fw.send(model, "hexStringIdentifier"))
            if not hex_id:
                raise DeviceError("_ANEInMemoryModel hexStringIdentifier returned nil")
            folder = Path(rt.temporary_directory()) / hex_id
            _acquire_folder(folder)
            handle = AneModel(self._fw, rt.retain(model), rt.retain(desc), hex_id, folder, mil_text)
            try:
                populate_folder(folder, mil_text, weights)
                # Charged before the call: the compiler's leak happens whether or not it succeeds.
                charge_compile(self.profile.compile_budget)
                err = rt.error_out()
                # Fact: -compileWithQoS:options:error: takes QoS as unsigned int (21), options @{}
                # and NSError**, and returns BOOL.
                if not self._fw.send(handle.ptr, "compileWithQoS:options:error:", QOS, rt.ns({}), byref(err)):
                    raise rt.error_from("compileWithQoS", err)
            except BaseException:
                handle.release()  # Orion deletes the folder of a failed compile
                raise
        self._models.add(handle)
        return handle

    def _describe(self, mil_text: str, weights: dict[str, bytes]) -> tuple[int, int]:
        rt, send = self._fw.rt, self._fw.send
        # Fact: the MIL goes in as UTF-8 NSData (an NSString crashes); weights as
        # {key: {"offset": 0, "data": NSData}}, an empty dict and never nil (nil makes the
        # compile fail silently); optionsPlist nil.
        wdict = rt.ns({k: {"offset": 0, "data": bytes(v)} for k, v in weights.items()})
        desc = send(None, "modelWithMILText:weights:optionsPlist:", rt.ns(mil_text.encode("utf-8")), wdict, None)
        if not desc:
            raise DeviceError("_ANEInMemoryModelDescriptor modelWithMILText:weights:optionsPlist: returned nil")
        # Fact: +[_ANEInMemoryModel inMemoryModelWithDescriptor:] makes the model from the descriptor.
        model = send(None, "inMemoryModelWithDescriptor:", desc)
        if not model:
            raise DeviceError("_ANEInMemoryModel inMemoryModelWithDescriptor: returned nil")
        return desc, model

    def load(self, model: AneModel) -> None:
        m = self._own(model)
        if m.loaded:
            return
        try:
            self._load_once(m)
        except DeviceError:
            time.sleep(LOAD_RETRY_DELAY_S)  # Fact: one retry after 100 ms ("ANE slot reclamation")
            self._load_once(m)
        m.loaded = True

    def _load_once(self, m: AneModel) -> None:
        rt = self._fw.rt
        with rt.pool():
            err = rt.error_out()
            # Fact: -loadWithQoS:options:error: takes QoS 21, options @{}, NSError**; returns BOOL.
            if not self._fw.send(m.ptr, "loadWithQoS:options:error:", QOS, rt.ns({}), byref(err)):
                raise rt.error_from("loadWithQoS", err)

    def evaluate(self, model: AneModel, inputs: list[Surface], outputs: list[Surface], watch: bool = False):
        m = self._own(model)
        if not m.loaded:
            raise DeviceError("evaluate: the model is not loaded; call device.load(model) first")
        ins = [Id(_wrapped(s, "input", i)) for i, s in enumerate(inputs)]
        outs = [Id(_wrapped(s, "output", i)) for i, s in enumerate(outputs)]
        rt = self._fw.rt
        with rt.pool():
            # Fact: the request takes NSArrays of surface objects and of NSNumber indices
            # 0..n-1 (the position is the binding), weightsBuffer nil, perfStats nil and
            # procedureIndex @0.
            req = self._fw.send(None, "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:"
                                "perfStats:procedureIndex:", rt.ns(ins), rt.ns(list(range(len(ins)))),
                                rt.ns(outs), rt.ns(list(range(len(outs)))), None, None, rt.ns(0))
            if not req:
                raise DeviceError("_ANERequest requestWithInputs:...procedureIndex: returned nil")
            err = rt.error_out()
            # Fact: -evaluateWithQoS:options:request:error: returns BOOL. The references'
            # training loops ignore it; we do not (bad surface sizes fail here, status 0x1d).
            if not self._fw.send(m.ptr, "evaluateWithQoS:options:request:error:", QOS, rt.ns({}), req, byref(err)):
                raise rt.error_from("evaluateWithQoS", err)
        return output_overflow(m, self.profile, inputs, outputs) if watch else None  # outputs only: §8

    def unload(self, model: AneModel) -> None:
        m = self._own(model)
        if m.loaded:
            m.loaded = False
            _unload(self._fw, m.ptr)

    def rewrite_weight(self, model: AneModel, path: str, blob: bytes) -> None:
        # Fact (Orion's delta reload): overwrite <folder>/<key minus @model_path/> between
        # unload and load. Whether the chip reads it is `reload_reads_new_weights`.
        m = self._own(model)
        target = m.folder / weight_relpath(path)
        if not target.exists():
            raise DeviceError(f"rewrite_weight: {path} is not a blob of this model (no {target})")
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(bytes(blob))
        os.replace(tmp, target)

    def close(self) -> None:
        for obj in [*self._models, *self._surfaces]:
            try:
                obj.release()
            except DeviceError:
                pass

    def _own(self, model) -> AneModel:
        if not isinstance(model, AneModel) or model.released:
            raise DeviceError(f"expected a live model from AneDevice.compile(), got {type(model).__name__}")
        return model

    def self_test(self) -> None:
        """Compile, run and check a tiny add on the chip; raise DeviceError if anything is off."""
        x = np.linspace(-8, 8, 64 * 384).astype(np.float16)  # 49,152 bytes: the minimum surface
        inp, out = surfaces = [self.new_surface(x.nbytes), self.new_surface(x.nbytes)]
        model = None
        try:
            model = self.compile(SELF_TEST_MIL, {})
            self.load(model)
            inp.write(x)
            out.write(np.full(x.size, np.nan, np.float16))  # poison: a request that writes nothing fails
            self.evaluate(model, [inp], [out])
            got = out.read(x.nbytes).view(np.float16).astype(np.float64)
        finally:
            for obj in [*surfaces, model]:
                if obj is not None:
                    obj.release()
        ref = x.astype(np.float64) + 0.5
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        if not err <= 2e-3:  # also catches NaN
            raise DeviceError(f"ANE self-test: add(x, 0.5) is off by {err:.3g} relative (tolerance 2e-3)")


def _wrapped(surface: Surface, kind: str, index: int) -> int:
    if not isinstance(surface, IOSurfaceBacked):
        raise DeviceError(f"{kind} surface {index} is a {type(surface).__name__}; "
                          "the ANE reads only surfaces from AneDevice.new_surface()")
    return surface.ane_object()
