"""Objective-C from Python through ctypes: the runtime the real ANE backend stands on.

Why ctypes and not PyObjC: it ships with Python, so nothing is installed on the user's Mac,
and every message send names its exact C prototype at the call site (`send(obj, "sel:",
restype, [argtypes], *args)`), which is what arm64 requires (see `Runtime.send`).

Nothing is loaded when this module is imported. `runtime()` dlopens libobjc, CoreFoundation,
Foundation and IOSurface on first use, once per process, and only on macOS.

Ownership follows Cocoa's rules: objects from `alloc`/`new`/`copy` and `...Create...` C
functions are ours (+1); everything else is autoreleased, so callers wrap work in
`with rt.pool():` and `retain` what must outlive the pool.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from contextlib import contextmanager
from ctypes import POINTER, c_char_p, c_int32, c_size_t, c_uint32, c_void_p

import numpy as np

from ...errors import DeviceError

LIBOBJC = "/usr/lib/libobjc.A.dylib"
COREFOUNDATION = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
FOUNDATION = "/System/Library/Frameworks/Foundation.framework/Foundation"
IOSURFACE = "/System/Library/Frameworks/IOSurface.framework/IOSurface"

# C types of the Objective-C ABI on 64-bit Apple platforms.
ID = c_void_p  # id, Class and SEL are all plain pointers
SEL = c_void_p
NSUInteger = ctypes.c_ulong  # LP64: unsigned long
NSInteger = ctypes.c_long
BOOL = ctypes.c_bool  # arm64 defines BOOL as C99 bool (x86_64 used signed char)
ERROR_OUT = POINTER(c_void_p)  # NSError **
LOCK_WRITE, LOCK_READ_ONLY = 0, 1  # IOSurfaceLockOptions: 0 = read/write, kIOSurfaceLockReadOnly = 1


class Id(int):
    """An Objective-C object pointer, so `ns()` passes it through instead of boxing a number."""


class ObjCError(DeviceError):
    """An NSError from a private call: carries `step`, `domain`, `code` and `description`."""

    def __init__(self, step: str, domain: str, code: int | None, description: str):
        self.step, self.domain, self.description = step, domain, description
        where = f"{domain} error {code}: " if domain else ""  # NSError codes may be negative: keep decimal
        super().__init__(f"{step} failed: {where}{description or 'no description'}")
        self.code = code


def _open(path: str) -> ctypes.CDLL:
    # Since macOS 11 system libraries live in the dyld shared cache, not as files on disk;
    # dlopen of the documented path still resolves them, so no existence check here.
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise DeviceError(f"cannot load {path}: {e}") from None


def _declare(fn, restype, argtypes) -> None:
    fn.restype, fn.argtypes = restype, list(argtypes)


class Runtime:
    """The loaded libraries and their typed entry points. One per process, via `runtime()`."""

    def __init__(self):
        self.objc = _open(LIBOBJC)
        self.cf = _open(COREFOUNDATION)
        self.foundation = _open(FOUNDATION)
        self.iosurface = _open(IOSURFACE)
        self._msgsend = ctypes.cast(self.objc.objc_msgSend, c_void_p).value
        self._protos: dict = {}
        self._sels: dict[str, int] = {}
        self._classes: dict[str, int] = {}
        self._declare_c_functions()

    def _declare_c_functions(self) -> None:
        # Each C prototype as the SDK headers declare it (objc/runtime.h, CFBase.h,
        # NSPathUtilities.h, IOSurfaceRef.h).
        _declare(self.objc.objc_getClass, ID, [c_char_p])
        _declare(self.objc.sel_registerName, SEL, [c_char_p])
        _declare(self.objc.class_getInstanceMethod, c_void_p, [c_void_p, SEL])  # -> Method or NULL
        _declare(self.objc.class_getClassMethod, c_void_p, [c_void_p, SEL])
        _declare(self.objc.method_getTypeEncoding, c_char_p, [c_void_p])
        _declare(self.cf.CFRelease, None, [c_void_p])
        _declare(self.foundation.NSTemporaryDirectory, ID, [])
        s = self.iosurface
        _declare(s.IOSurfaceCreate, c_void_p, [c_void_p])  # (CFDictionaryRef) -> IOSurfaceRef, +1
        _declare(s.IOSurfaceLock, c_int32, [c_void_p, c_uint32, POINTER(c_uint32)])  # kern_return_t
        _declare(s.IOSurfaceUnlock, c_int32, [c_void_p, c_uint32, POINTER(c_uint32)])
        _declare(s.IOSurfaceGetBaseAddress, c_void_p, [c_void_p])
        _declare(s.IOSurfaceGetAllocSize, c_size_t, [c_void_p])

    # ---------------------------------------------------------------- messaging
    def send(self, receiver, selector: str, restype, argtypes, *args):
        """`objc_msgSend(receiver, @selector(selector), *args)` through an exact prototype.

        objc_msgSend jumps straight into the method, so the caller must pass arguments the
        way the method expects. On arm64 variadic arguments go on the stack and fixed ones
        in registers, so calling it as a variadic C function breaks; we build one
        non-variadic function type per (restype, argtypes) and call through that.
        """
        if selector.count(":") != len(argtypes) or len(args) != len(argtypes):
            raise TypeError(f"-{selector}: {len(argtypes)} argtypes and {len(args)} args for "
                            f"{selector.count(':')} selector arguments")
        key = (restype, tuple(argtypes))
        fn = self._protos.get(key)
        if fn is None:
            fn = ctypes.CFUNCTYPE(restype, ID, SEL, *argtypes)(self._msgsend)
            self._protos[key] = fn
        return fn(receiver, self.sel(selector), *args)

    def sel(self, name: str) -> int:
        s = self._sels.get(name)
        if s is None:
            s = self._sels[name] = self.objc.sel_registerName(name.encode())
        return s

    def cls(self, name: str) -> int:
        """A class by name; a typed error if the loaded images do not define it."""
        c = self._classes.get(name)
        if c is None:
            c = self.objc.objc_getClass(name.encode())
            if not c:
                raise DeviceError(f"Objective-C class {name} not found in the loaded frameworks")
            self._classes[name] = c
        return c

    def check_prototype(self, cls_name: str, class_method: bool, selector: str, restype, argtypes) -> str | None:
        """Compare our prototype with the method's runtime type encoding.

        A missing method raises: sending it would throw an Objective-C exception, which
        aborts the process. A differing encoding is returned as a warning, for the self-test
        and `anelm doctor` to weigh; None means it matches (or the runtime gives no encoding).
        """
        kind = "+" if class_method else "-"
        get = self.objc.class_getClassMethod if class_method else self.objc.class_getInstanceMethod
        method = get(self.cls(cls_name), self.sel(selector))
        if not method:
            raise DeviceError(f"{kind}[{cls_name} {selector}] is gone: this macOS changed the private API")
        raw = self.objc.method_getTypeEncoding(method)
        if not raw:
            return None
        tokens = encoding_tokens(raw.decode("ascii", "replace"))
        ours = [restype, ID, SEL, *argtypes]
        if len(tokens) == len(ours) and all(_kind(t) in _ACCEPTS.get(c, ()) for t, c in zip(tokens, ours)):
            return None
        return f"{kind}[{cls_name} {selector}] has type encoding {raw.decode('ascii', 'replace')}, not what we call"

    # ---------------------------------------------------------------- ownership
    def retain(self, obj):
        return self.send(obj, "retain", ID, []) if obj else obj

    def release(self, obj) -> None:
        if obj:
            self.send(obj, "release", None, [])

    def cf_release(self, ref) -> None:
        if ref:
            self.cf.CFRelease(ref)

    @contextmanager
    def pool(self):
        """An autorelease pool around a block: temporaries die at its end, deterministically."""
        p = self.send(self.send(self.cls("NSAutoreleasePool"), "alloc", ID, []), "init", ID, [])
        try:
            yield
        finally:
            self.send(p, "drain", None, [])

    # ---------------------------------------------------------------- values
    def ns(self, value) -> int | None:
        """Box a Python value as an autoreleased Foundation object (call inside a pool).

        str → NSString, bytes → NSData (copied), bool/int (numpy's too) → NSNumber, dict →
        NSDictionary, list/tuple → NSArray, `Id` → itself, None → nil.
        """
        if value is None or isinstance(value, Id):
            return value
        if isinstance(value, str):
            return self.send(self.cls("NSString"), "stringWithUTF8String:", ID, [c_char_p], value.encode())
        if isinstance(value, (bytes, bytearray, memoryview)):  # small values: a copy is simpler
            data = bytes(value)
            return self.send(self.cls("NSData"), "dataWithBytes:length:", ID, [c_char_p, NSUInteger],
                             data, len(data))
        if isinstance(value, (bool, np.bool_)):
            return self.send(self.cls("NSNumber"), "numberWithBool:", ID, [BOOL], bool(value))
        if isinstance(value, (int, np.integer)):  # sizes from np.prod are numpy ints, not int
            return self.send(self.cls("NSNumber"), "numberWithLongLong:", ID, [ctypes.c_longlong], int(value))
        if isinstance(value, dict):
            return self._nsdict(value)
        if isinstance(value, (list, tuple)):
            objs = self._ids(value)
            return self.send(self.cls("NSArray"), "arrayWithObjects:count:", ID, [POINTER(ID), NSUInteger],
                             objs, len(value))
        raise TypeError(f"cannot box {type(value).__name__} as a Foundation object")

    def _ids(self, values) -> ctypes.Array:
        ids = [self.ns(v) for v in values]
        if any(not i for i in ids):
            raise TypeError("Foundation collections cannot hold nil")
        return (ID * max(len(ids), 1))(*ids)

    def _nsdict(self, d: dict) -> int:
        keys, vals = self._ids(list(d)), self._ids(list(d.values()))
        return self.send(self.cls("NSDictionary"), "dictionaryWithObjects:forKeys:count:", ID,
                         [POINTER(ID), POINTER(ID), NSUInteger], vals, keys, len(d))

    def data_no_copy(self, buffer) -> Id:
        """An autoreleased NSData over `buffer`'s own memory (no copy, never freed by Foundation).

        The caller keeps `buffer` alive and unchanged for as long as the NSData may be read.
        """
        addr, n = buffer_address(buffer)
        data = self.send(self.cls("NSData"), "dataWithBytesNoCopy:length:freeWhenDone:", ID,
                         [c_void_p, NSUInteger, BOOL], addr, n, False)
        if not data:
            raise DeviceError(f"NSData dataWithBytesNoCopy: returned nil for {n} bytes")
        return Id(data)

    def string(self, nsstring) -> str:
        """An NSString as a Python str ('' for nil)."""
        if not nsstring:
            return ""
        raw = self.send(nsstring, "UTF8String", c_char_p, [])
        return raw.decode("utf-8", "replace") if raw else ""

    def temporary_directory(self) -> str:
        """NSTemporaryDirectory(): the per-user folder the framework compiles into."""
        with self.pool():  # it returns an autoreleased NSString: without a pool it leaks
            return self.string(self.foundation.NSTemporaryDirectory())

    def constant(self, lib: ctypes.CDLL, name: str) -> Id:
        """An exported `const CFStringRef` such as kIOSurfaceWidth."""
        try:
            return Id(c_void_p.in_dll(lib, name).value)
        except ValueError:
            raise DeviceError(f"symbol {name} not found") from None

    # ---------------------------------------------------------------- IOSurface
    def iosurface_create(self, properties: dict[str, int]) -> int:
        """IOSurfaceCreate from {"kIOSurfaceWidth": n, ...}; the caller owns the result (+1)."""
        props = {self.constant(self.iosurface, k): v for k, v in properties.items()}
        with self.pool():
            ref = self.iosurface.IOSurfaceCreate(self.ns(props))  # NSDictionary is toll-free CFDictionary
        if not ref:
            raise DeviceError(f"IOSurfaceCreate returned NULL for {properties}")
        return ref

    @contextmanager
    def iosurface_locked(self, ref, options: int):
        """Hold IOSurfaceLock(ref, options, NULL) for a block; yields the base address."""
        if not ref:
            raise DeviceError("surface was released; allocate a new one with device.new_surface()")
        kr = self.iosurface.IOSurfaceLock(ref, options, None)
        if kr != 0:
            raise DeviceError(f"IOSurfaceLock failed: kern_return_t 0x{kr & 0xFFFFFFFF:08x}")
        try:
            base = self.iosurface.IOSurfaceGetBaseAddress(ref)
            if not base:
                raise DeviceError("IOSurfaceGetBaseAddress returned NULL")
            yield base
        finally:
            self.iosurface.IOSurfaceUnlock(ref, options, None)

    # ---------------------------------------------------------------- errors
    @staticmethod
    def error_out() -> c_void_p:
        """A fresh NSError* slot; pass `ctypes.byref(slot)` as the `error:` argument."""
        return c_void_p(None)

    def error_from(self, step: str, slot: c_void_p) -> ObjCError:
        """The NSError a call left in `slot` (read it before the enclosing pool drains)."""
        err = slot.value
        if not err:
            return ObjCError(step, "", None, "returned NO without an NSError")
        domain = self.string(self.send(err, "domain", ID, []))
        code = self.send(err, "code", NSInteger, [])
        desc = self.string(self.send(err, "localizedDescription", ID, []))
        return ObjCError(step, domain, code, desc)


def buffer_address(buffer) -> tuple[int, int]:
    """(address, length) of a bytes-like object's own memory, without copying it."""
    view = np.frombuffer(buffer, dtype=np.uint8)  # shares the buffer, read-only ones included
    return (view.ctypes.data if view.size else 0), int(view.size)


def encoding_tokens(enc: str) -> list[str]:
    """Split an Objective-C method type encoding ("B40@0:8I16@20^@28") into one token per type."""
    out, i = [], 0
    while i < len(enc):
        if enc[i].isdigit() or enc[i] in "rnNoORV":  # frame offsets and type qualifiers
            i += 1
            continue
        start = i
        while i < len(enc) and enc[i] == "^":
            i += 1
        if i < len(enc) and enc[i] in "{([":
            depth = 0
            while i < len(enc):
                depth += (enc[i] in "{([") - (enc[i] in "})]")
                i += 1
                if depth == 0:
                    break
        elif enc.startswith('@"', i):  # @"NSString"
            i = enc.index('"', i + 2) + 1
        else:
            i += 2 if enc.startswith("@?", i) else 1
        out.append(enc[start:i])
    return out


def _kind(token: str) -> str:
    if token.startswith("^"):
        return "^@" if token == "^@" else "ptr"
    return {"@": "obj", "#": "obj", ":": "sel", "B": "bool", "c": "bool", "C": "u8", "I": "u32", "i": "i32",
            "L": "u64", "Q": "u64", "l": "i64", "q": "i64", "v": "void", "*": "ptr"}.get(token[0], token)


# which runtime kinds each ctypes type may stand for (BOOL is 'B' on arm64, 'c' on x86_64)
_ACCEPTS = {ID: {"obj", "ptr", "sel"}, ERROR_OUT: {"^@"}, ctypes.c_uint: {"u32"}, BOOL: {"bool"},
            None: {"void"}, c_char_p: {"ptr"}, NSUInteger: {"u64"}, NSInteger: {"i64"}, ctypes.c_longlong: {"i64"}}


class IOSurfaceBuffer:
    """A CPU view of one IOSurface: packed reads and writes, each under IOSurfaceLock.

    Writes lock with 0 (read/write), reads with kIOSurfaceLockReadOnly, as the references do.
    `release()` CFReleases the surface at once (IOSurfaceCreate's Create rule: we own it).
    """

    def __init__(self, rt: Runtime, nbytes: int, properties: dict[str, int]):
        if int(nbytes) <= 0:
            raise ValueError(f"surface size must be positive, got {nbytes}")
        self.nbytes, self._rt, self.ref = int(nbytes), rt, None
        self.ref = rt.iosurface_create(properties)

    @property
    def released(self) -> bool:
        return self.ref is None

    def write(self, data, offset: int = 0) -> None:
        raw = (np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview))
               else np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        if offset < 0 or offset + raw.size > self.nbytes:
            raise ValueError(f"write of {raw.size} bytes at {offset} overruns a {self.nbytes}-byte surface")
        with self._rt.iosurface_locked(self.ref, LOCK_WRITE) as base:
            ctypes.memmove(base + int(offset), raw.ctypes.data, raw.size)  # c_void_p takes no numpy int

    def read(self, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """A copy of `nbytes` bytes from `offset` as uint8."""
        n = self.nbytes - offset if nbytes is None else int(nbytes)
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"read of {n} bytes at {offset} overruns a {self.nbytes}-byte surface")
        out = np.empty(n, dtype=np.uint8)
        with self._rt.iosurface_locked(self.ref, LOCK_READ_ONLY) as base:
            ctypes.memmove(out.ctypes.data, base + int(offset), n)
        return out

    def release(self) -> None:
        ref, self.ref = self.ref, None
        if ref:
            self._rt.cf_release(ref)
            self.nbytes = 0

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the runtime may already be gone
            pass


_lock = threading.Lock()
_runtime: Runtime | None = None


def runtime() -> Runtime:
    """The process's Objective-C runtime, loaded on first use (macOS only)."""
    global _runtime
    with _lock:
        if _runtime is None:
            if sys.platform != "darwin":
                raise DeviceError(f"the Objective-C runtime needs macOS; this is {sys.platform}")
            _runtime = Runtime()
        return _runtime


def loaded() -> bool:
    """Whether anything has been dlopened yet (import alone must leave this False)."""
    return _runtime is not None
