"""The seam between anelm and AppleNeuralEngine.framework: one method per private call.

`ane.AneDevice` decides *when* to compile, load, unload and re-create folders; this module
only *makes* the calls, in plain Python values (ints for retained objects, bytes, str), so a
test can replace the whole framework with a fake one (tests/device/ane_fake.py) that behaves
as the decompiled framework does: its unload deletes the compile folder, aned keeps compiled
programs by hash. Every method that makes temporaries drains its own autorelease pool.

Nothing is loaded when this module is imported; `framework()` does, on macOS/arm64.
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import byref, c_uint, c_void_p

import numpy as np

from ...errors import DeviceError
from . import objc
from ..base import Surface
from .objc import BOOL, ERROR_OUT, ID, SEL, Id

FRAMEWORK_DIR = "/System/Library/PrivateFrameworks/AppleNeuralEngine.framework"
FRAMEWORK = f"{FRAMEWORK_DIR}/AppleNeuralEngine"
CLASSES = ("_ANEInMemoryModelDescriptor", "_ANEInMemoryModel", "_ANERequest", "_ANEIOSurfaceObject")
QOS = 21  # every reference passes 21 (the M5 sweep found 0-63 all work; 0 loads slowly)

# Every private message we send, with the exact prototype it is sent through (facts:
# maderix/ANE's training_dynamic/io.h and bridge/ane_bridge.m, Orion's core/ane_runtime.m, and
# the framework's own method list for compiledModelExists). Checked against the runtime when
# the framework loads: a missing selector makes the backend unavailable instead of aborting
# the process.
PRIVATE_CALLS = {  # selector: (class, class method?, restype, argtypes)
    "modelWithMILText:weights:optionsPlist:": ("_ANEInMemoryModelDescriptor", True, ID, [ID, ID, ID]),
    "inMemoryModelWithDescriptor:": ("_ANEInMemoryModel", True, ID, [ID]),
    "hexStringIdentifier": ("_ANEInMemoryModel", False, ID, []),
    "compiledModelExists": ("_ANEInMemoryModel", False, BOOL, []),
    "compileWithQoS:options:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ID, ERROR_OUT]),
    "loadWithQoS:options:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ID, ERROR_OUT]),
    "evaluateWithQoS:options:request:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ID, ID, ERROR_OUT]),
    "unloadWithQoS:error:": ("_ANEInMemoryModel", False, BOOL, [c_uint, ERROR_OUT]),
    "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:perfStats:procedureIndex:":
        ("_ANERequest", True, ID, [ID, ID, ID, ID, ID, ID, ID]),
    "objectWithIOSurface:": ("_ANEIOSurfaceObject", True, ID, [c_void_p]),
}
# Calls the backend can do without: a framework that lacks one still loads (with a warning),
# and the call is probed with respondsToSelector: before it is sent. Without
# compiledModelExists every program is compiled cold, and charged.
OPTIONAL_CALLS = ("compiledModelExists",)


def check_calls(rt) -> list[str]:
    """Every PRIVATE_CALLS prototype against the runtime: the warnings; a missing call that is
    not optional raises (sending it would throw an Objective-C exception, aborting the process)."""
    warnings = []
    for sel, (cls, is_cls, res, args) in PRIVATE_CALLS.items():
        try:
            w = rt.check_prototype(cls, is_cls, sel, res, args)
        except DeviceError as e:
            if sel not in OPTIONAL_CALLS:
                raise
            w = f"{e}; every program will be compiled cold"
        warnings += [w] if w else []
    return warnings


class Framework:
    """The loaded framework: the ObjC runtime, the four private classes, the checked prototypes."""

    _has_exists: bool | None = None  # whether models respond to compiledModelExists (asked once)

    def __init__(self):
        self.rt = objc.runtime()
        try:
            # Fact: the references dlopen this exact path with RTLD_NOW before looking classes up.
            self.lib = ctypes.CDLL(FRAMEWORK, mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise DeviceError(f"cannot load {FRAMEWORK}: {e}") from None
        # Fact: all four classes are required (Orion's init refuses to start without one).
        self.classes = {name: self.rt.cls(name) for name in CLASSES}
        self.warnings = check_calls(self.rt)

    def send(self, receiver, selector: str, *args):
        """A private message, through the prototype PRIVATE_CALLS gives it."""
        cls, is_class, restype, argtypes = PRIVATE_CALLS[selector]
        target = self.classes[cls] if is_class else receiver
        return self.rt.send(target, selector, restype, argtypes, *args)

    # ------------------------------------------------------------------ the seam
    def temporary_directory(self) -> str:
        """NSTemporaryDirectory(): where the framework puts `<hex>/` (its localModelPath)."""
        return self.rt.temporary_directory()

    def new_model(self, mil_text: bytes, weights: dict[str, bytes]) -> tuple[int, str]:
        """A retained `_ANEInMemoryModel` and its hex id. The descriptor is not kept.

        The framework drops its own reference to the descriptor once it has written the
        files (`setDescriptor:nil` in saveModelFiles), so retaining it would keep the MIL
        and every blob alive a second time. The blobs go in without a copy
        (`dataWithBytesNoCopy:length:freeWhenDone:NO`): the caller keeps `weights` alive
        (AneModel does, to re-create its folder), and that is the only copy in this process.
        """
        rt = self.rt
        with rt.pool():
            # Fact: the MIL goes in as UTF-8 NSData (an NSString crashes); weights as
            # {key: {"offset": 0, "data": NSData}}, an empty dict and never nil (nil makes the
            # compile fail silently); optionsPlist nil.
            wdict = rt.ns({k: {"offset": 0, "data": rt.data_no_copy(v)} for k, v in weights.items()})
            desc = self.send(None, "modelWithMILText:weights:optionsPlist:", rt.data_no_copy(mil_text), wdict, None)
            if not desc:
                raise DeviceError("_ANEInMemoryModelDescriptor modelWithMILText:weights:optionsPlist: returned nil")
            # Fact: +[_ANEInMemoryModel inMemoryModelWithDescriptor:] makes the model (it holds
            # the descriptor itself until its files are written).
            model = self.send(None, "inMemoryModelWithDescriptor:", desc)
            if not model:
                raise DeviceError("_ANEInMemoryModel inMemoryModelWithDescriptor: returned nil")
            # Fact: -hexStringIdentifier names the compile folder. The descriptor builds it
            # from hashes of the MIL text, of the weight blobs' bytes and of the options plist.
            hex_id = rt.string(self.send(model, "hexStringIdentifier"))
            if not hex_id:
                raise DeviceError("_ANEInMemoryModel hexStringIdentifier returned nil")
            return rt.retain(model), hex_id

    def compiled_model_exists(self, model: int) -> bool:
        """Fact: -compiledModelExists asks aned whether it holds a program for this hex id
        (libane skips the compile when it does). A framework without it answers False."""
        rt = self.rt
        with rt.pool():
            if self._has_exists is None:  # sending a selector the model lacks would abort us
                sel = rt.sel("compiledModelExists")
                self._has_exists = bool(rt.send(model, "respondsToSelector:", BOOL, [SEL], sel))
            return self._has_exists and bool(self.send(model, "compiledModelExists"))

    def compile(self, model: int) -> None:
        rt = self.rt
        with rt.pool():
            err = rt.error_out()
            # Fact: -compileWithQoS:options:error: takes QoS as unsigned int (21), options @{}
            # and NSError**, and returns BOOL.
            if not self.send(model, "compileWithQoS:options:error:", QOS, rt.ns({}), byref(err)):
                raise rt.error_from("compileWithQoS", err)

    def load(self, model: int) -> None:
        rt = self.rt
        with rt.pool():
            err = rt.error_out()
            # Fact: -loadWithQoS:options:error: takes QoS 21, options @{}, NSError**; returns BOOL.
            if not self.send(model, "loadWithQoS:options:error:", QOS, rt.ns({}), byref(err)):
                raise rt.error_from("loadWithQoS", err)

    def unload(self, model: int) -> None:
        rt = self.rt
        with rt.pool():
            err = rt.error_out()
            # Fact: -unloadWithQoS:error: takes the QoS and an NSError** (no options argument).
            # Afterwards the framework deletes the model's folder (maderix/ANE's training_dynamic/io.h).
            if not self.send(model, "unloadWithQoS:error:", QOS, byref(err)):
                raise rt.error_from("unloadWithQoS", err)

    def new_surface(self, nbytes: int) -> "IOSurfaceBacked":
        return IOSurfaceBacked(self, nbytes)

    def owns(self, surface) -> bool:
        return isinstance(surface, IOSurfaceBacked)

    def new_request(self, inputs: list["IOSurfaceBacked"], outputs: list["IOSurfaceBacked"]) -> int:
        """A retained `_ANERequest` binding these surfaces by position, for reuse across evaluations."""
        rt = self.rt
        ins, outs = [Id(s.ane_object()) for s in inputs], [Id(s.ane_object()) for s in outputs]
        with rt.pool():
            # Fact: NSArrays of surface objects and of NSNumber indices 0..n-1 (the position is
            # the binding), weightsBuffer nil, perfStats nil and procedureIndex @0. maderix
            # builds one request per kernel and reuses it.
            req = self.send(None, "requestWithInputs:inputIndices:outputs:outputIndices:weightsBuffer:"
                            "perfStats:procedureIndex:", rt.ns(ins), rt.ns(list(range(len(ins)))),
                            rt.ns(outs), rt.ns(list(range(len(outs)))), None, None, rt.ns(0))
            if not req:
                raise DeviceError("_ANERequest requestWithInputs:...procedureIndex: returned nil")
            return rt.retain(req)

    def evaluate(self, model: int, request: int) -> None:
        rt = self.rt
        with rt.pool():
            err = rt.error_out()
            # Fact: -evaluateWithQoS:options:request:error: returns BOOL. The references'
            # training loops ignore it; we do not (bad surface sizes fail here, status 0x1d).
            if not self.send(model, "evaluateWithQoS:options:request:error:", QOS, rt.ns({}), request, byref(err)):
                raise rt.error_from("evaluateWithQoS", err)

    def release(self, *objs: int) -> None:
        """Release retained objects inside a pool: a dealloc may autorelease temporaries."""
        with self.rt.pool():
            for obj in objs:
                self.rt.release(obj)


class IOSurfaceBacked(objc.IOSurfaceBuffer, Surface):
    """A flat IOSurface, locked for every read and write; `release()` CFReleases it at once."""

    def __init__(self, fw: Framework, nbytes: int):
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
            self._fw.release(wrap)
        super().release()


_fw: Framework | None = None
_fw_lock = threading.Lock()


def framework() -> Framework:
    """The process's loaded framework (loaded on first use)."""
    global _fw
    with _fw_lock:
        if _fw is None:
            _fw = Framework()
        return _fw


def loaded() -> bool:
    return _fw is not None
