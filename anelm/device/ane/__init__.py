"""The real Apple Neural Engine behind the Device interface: when to compile, load and unload.

The private calls themselves are in `ane.framework` (one method each, the seam a test
replaces with a fake framework); this module owns the rules around them:
- aned may already hold the program (`compiledModelExists`): then nothing is compiled and
  nothing is charged against the compile budget (only cold compiles count);
- the framework's unload deletes the model's compile folder, so the folder is re-created
  from the model's own text and blobs before a load finds it missing (atomically, never
  rewritten in place), and our release deletes it only when no other model uses it;
- a load that fails twice is a cold compile and a third try (aned may have dropped it);
- a model is marked unloaded only once the unload succeeded, so a failed one is retried.
docs/ane-backend.md lists every call in order with where each fact comes from.
Importing this module loads nothing; `available()` and `AneDevice()` do, on macOS/arm64.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ...atomic import atomic_dir
from ...chip.profile import STRICT, ChipProfile
from ...errors import BlobError, DeviceError
from ...mil.folder import MODEL_FILE, relative_path, write_model_folder
from . import framework as ane_framework
from .framework import CLASSES, FRAMEWORK, FRAMEWORK_DIR, PRIVATE_CALLS, IOSurfaceBacked  # noqa: F401
from ..base import Device, Surface, charge_compile
from ..overflow import output_overflow

LOAD_RETRY_DELAY_S = 0.1  # maderix's bridge retries a failed load once after 100 ms
# surface sets whose _ANERequest is kept for reuse, per model: a training step's dynamic kernels
# bind one set per layer (Qwen3-0.6B: 28), its attention kernels one per layer, slot and sequence
# where the probabilities stay on the device; past this many, every evaluation would build one
REQUESTS_PER_MODEL = 512


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
        fw = ane_framework.framework()
    except Exception as e:  # noqa: BLE001 - whatever a load fails with is the reason, never a crash
        return False, str(e) if isinstance(e, DeviceError) else f"{type(e).__name__}: {e}"
    why = f"AppleNeuralEngine.framework loaded; its four classes and {len(PRIVATE_CALLS)} selectors resolved"
    return True, why + (f"; prototype warnings (the self-test decides): {'; '.join(fw.warnings)}" if fw.warnings else "")


# ----------------------------------------------------------------------------- compile folder
# Identical programs (same text, blobs and options) get the same hex id and so the same
# folder, in every process. It is created only when missing, and atomically (built beside it,
# then renamed), so no model compiles or loads from a half-written or rewritten folder. The
# framework's unload deletes it whoever else uses it, so a model re-creates it before a load
# that finds it gone. Our release deletes it only when no other model uses it: the user count
# covers this process, and a shared lock on one byte of `.anelm-folders.lock` (one per folder,
# held while this process uses it) covers the others. One file for every folder keeps this to
# one descriptor per process, however many programs are live.
_folder_users: dict[str, int] = {}
_folder_lock = threading.Lock()
_lock_files: dict[str, int] = {}  # lock file -> descriptor, open for the process's life:
# closing any descriptor of the file would drop every lock the process holds on it


def weight_relpath(key: str) -> str:
    """`@model_path/weights/wq.bin` → `weights/wq.bin`; a key that leaves the folder is a
    request the device refuses."""
    try:
        return relative_path(key)
    except BlobError as e:
        raise DeviceError(str(e)) from None


def populate_folder(folder: Path, mil_text: str | bytes, weights: dict[str, bytes]) -> None:
    """Fact: every reference pre-populates NSTemporaryDirectory()/<hex>/ before compiling,
    with model.mil, a weights/ folder, and each blob at its key minus "@model_path/"."""
    for key in weights:
        weight_relpath(key)
    write_model_folder(folder, mil_text, weights)


def ensure_folder(folder: Path, mil_text: str | bytes, weights: dict[str, bytes]) -> bool:
    """Create the folder when it is missing or incomplete, atomically; True if it was made."""
    if all(f.is_file() for f in [folder / MODEL_FILE, *(folder / weight_relpath(k) for k in weights)]):
        return False  # never rewritten in place: another model may be compiling or loading from it
    with atomic_dir(folder, replace=folder.exists()) as tmp:  # a partial folder is replaced
        populate_folder(tmp, mil_text, weights)
    return True


def _lock_byte(folder: Path) -> tuple[int, int]:
    """The lock file's descriptor and the byte that stands for `folder` (two folders that
    share a byte only keep each other)."""
    path = str(folder.parent / ".anelm-folders.lock")
    if path not in _lock_files:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _lock_files[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    byte = hashlib.blake2s(folder.name.encode(), digest_size=4).digest()
    return _lock_files[path], int.from_bytes(byte, "little")


def _acquire_folder(folder: Path) -> None:
    import fcntl  # noqa: PLC0415 - an extension module: importing the backend loads nothing

    with _folder_lock:
        if not _folder_users.get(str(folder)):
            fd, byte = _lock_byte(folder)
            fcntl.lockf(fd, fcntl.LOCK_SH, 1, byte)  # waits while another process deletes it
        _folder_users[str(folder)] = _folder_users.get(str(folder), 0) + 1


def _drop_folder(folder: Path) -> None:
    import fcntl  # noqa: PLC0415

    with _folder_lock:
        n = _folder_users.pop(str(folder), 1) - 1
        if n > 0:
            _folder_users[str(folder)] = n
            return
        fd, byte = _lock_byte(folder)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)  # refused while another process holds it
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass  # another process's model uses the folder: it stays
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte)


class AneModel:
    """A program: the retained `_ANEInMemoryModel`, its hex id, folder, text and blobs.

    The text and blobs are the caller's own objects, referenced rather than copied: they
    re-create the folder when a load finds it gone and back the NSData the framework was
    handed, so a blob `rewrite_weight` replaced is kept (`superseded`) until the release.
    `compiled` says whether this process compiled it (False: aned already held it).
    `release()` (also on `device.close()` or when the handle is dropped) frees it all.
    """

    def __init__(self, fw, ptr: int, hex_id: str, folder: Path, mil: bytes, weights: dict[str, bytes]):
        self._fw, self.ptr, self.hex_id, self.folder = fw, ptr, hex_id, folder
        self.mil, self.weights, self.superseded = mil, dict(weights), {}
        self.loaded = self.compiled = self.holds_folder = False
        self._requests: OrderedDict = OrderedDict()  # surface ids -> (request, surfaces)
        self._requests_lock = threading.Lock()  # evaluations from several threads share the cache

    @property
    def mil_text(self) -> str:  # names the outputs for the fp16 overflow check
        return self.mil.decode("utf-8")

    @property
    def released(self) -> bool:
        return self.ptr is None

    def request(self, inputs: list[Surface], outputs: list[Surface]) -> int:
        """The retained `_ANERequest` for these surfaces, built once and reused."""
        key = (tuple(map(id, inputs)), tuple(map(id, outputs)))
        with self._requests_lock:
            hit = self._requests.get(key)
            if hit is not None and not any(s.released for s in hit[1]):
                self._requests.move_to_end(key)
                return hit[0]
            if hit is not None:
                self._fw.release(self._requests.pop(key)[0])
            req = self._fw.new_request(inputs, outputs)
            self._requests[key] = (req, [*inputs, *outputs])  # held, so no id is reused while cached
            while len(self._requests) > REQUESTS_PER_MODEL:
                self._fw.release(self._requests.popitem(last=False)[1][0])
            return req

    def release(self) -> None:
        if self.ptr is None:
            return
        ptr, self.ptr, was_loaded, self.loaded = self.ptr, None, self.loaded, False
        with self._requests_lock:
            requests = [r for r, _ in self._requests.values()]
            self._requests.clear()
        try:
            if was_loaded:
                self._fw.unload(ptr)
        finally:
            self._fw.release(*requests, ptr)
            if self.holds_folder:
                _drop_folder(self.folder)
            self.mil, self.weights, self.superseded = b"", {}, {}  # only now: the NSData pointed at them

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown: the runtime may already be gone
            pass


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
    """The real ANE behind the Device interface; raises DeviceError where it cannot run.

    `framework` is the seam (default: the loaded AppleNeuralEngine.framework); tests pass
    a fake that behaves as the framework does.
    """

    name = "ane"

    def __init__(self, profile: ChipProfile = STRICT, framework=None):
        super().__init__(profile)
        if framework is None:
            ok, why = available()
            if not ok:
                raise DeviceError(f"the ANE backend is unavailable: {why}")
            framework = ane_framework.framework()
        self._fw = framework
        self._models, self._surfaces = weakref.WeakSet(), weakref.WeakSet()  # released on close()

    def new_surface(self, nbytes: int) -> Surface:
        s = self._fw.new_surface(nbytes)
        self._surfaces.add(s)
        return s

    def compile(self, mil_text: str, weights: dict[str, bytes], key: str | None = None) -> AneModel:
        """A program for this text and these blobs; a cold compile only when aned lacks it.
        aned names programs by its own content id (`hexStringIdentifier`), so `key` is not
        needed here: asking aned is the only check that knows what it still holds."""
        for key in weights:
            weight_relpath(key)  # refuse bad keys before any private call
        mil = mil_text.encode("utf-8")
        ptr, hex_id = self._fw.new_model(mil, weights)
        handle = AneModel(self._fw, ptr, hex_id, Path(self._fw.temporary_directory()) / hex_id, mil, weights)
        try:
            _acquire_folder(handle.folder)  # before the folder is made: a release elsewhere must see us
            handle.holds_folder = True
            ensure_folder(handle.folder, mil, weights)
            # Fact (libane): aned keeps compiled programs by hex id across processes; loading
            # one is not a compile and costs no budget (only cold compiles count).
            if not self._fw.compiled_model_exists(ptr):
                # Charged before the call: the compiler's leak happens whether or not it succeeds.
                charge_compile(self.profile.compile_budget)
                self._fw.compile(ptr)
                handle.compiled = True
        except BaseException:
            handle.release()  # Orion deletes the folder of a failed compile (here: unless it is shared)
            raise
        self._models.add(handle)
        return handle

    def load(self, model: AneModel) -> None:
        m = self._own(model)
        if m.loaded:
            return
        try:
            self._load_once(m)
        except DeviceError:
            time.sleep(LOAD_RETRY_DELAY_S)  # Fact: one retry after 100 ms ("ANE slot reclamation")
            try:
                self._load_once(m)
            except DeviceError:
                # aned may no longer hold what compiledModelExists promised (or never built it
                # right): compile again, charged as every cold compile is, and load that.
                charge_compile(self.profile.compile_budget)
                self._fw.compile(m.ptr)
                m.compiled = True
                self._load_once(m)
        m.loaded = True

    def _load_once(self, m: AneModel) -> None:
        # The framework's unload deleted the folder (and so may another model's unload of the
        # same hex id): put back what this model was made from, plus any rewritten blobs.
        ensure_folder(m.folder, m.mil, m.weights)
        self._fw.load(m.ptr)

    def evaluate(self, model: AneModel, inputs: list[Surface], outputs: list[Surface], watch: bool = False,
                 read_columns: int | None = None, batched: bool = False,
                 only: tuple[str, ...] | None = None):  # the chip computes every column and output
        m = self._own(model)
        if not m.loaded:
            raise DeviceError("evaluate: the model is not loaded; call device.load(model) first")
        for kind, surfaces in (("input", inputs), ("output", outputs)):
            for i, s in enumerate(surfaces):
                if not self._fw.owns(s):
                    raise DeviceError(f"{kind} surface {i} is a {type(s).__name__}; "
                                      "the ANE reads only surfaces from AneDevice.new_surface()")
        self._fw.evaluate(m.ptr, m.request(list(inputs), list(outputs)))
        return output_overflow(m, self.profile, inputs, outputs) if watch else None  # outputs only

    def unload(self, model: AneModel) -> None:
        m = self._own(model)
        if m.loaded:
            self._fw.unload(m.ptr)  # raises on failure: the model stays loaded, and a retry unloads it
            m.loaded = False

    def rewrite_weight(self, model: AneModel, path: str, blob: bytes) -> None:
        """Replace a blob in the model's folder (Orion's delta reload), before or after unload.

        A load re-creates a missing folder from the model's blobs, so the new blob is
        recorded there too. The hex id still names the original weights, so on a Mac aned
        serves the program compiled from them (`sem.reload_weights` reads "old" either way).
        """
        m = self._own(model)
        if path not in m.weights:
            raise DeviceError(f"rewrite_weight: {path} is not a blob of this model; "
                              f"expected one of {sorted(m.weights) or 'none'}")
        m.superseded.setdefault(path, m.weights[path])  # the original: NoCopy NSData may point at it
        m.weights[path] = blob
        target = m.folder / weight_relpath(path)
        if not (m.folder / MODEL_FILE).is_file():
            return  # gone (an unload): the next load re-creates the whole folder, with this blob
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(blob)
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
        """Compile, run and check a tiny add on the chip; raise DeviceError if anything is off.

        Run in a child process by `--device auto` (`device/ane/selftest.py`): a crash here must
        not take the user's process with it.
        """
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
            for obj in [model, *surfaces]:
                if obj is not None:
                    obj.release()
        ref = x.astype(np.float64) + 0.5
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        if not err <= 2e-3:  # also catches NaN
            raise DeviceError(f"ANE self-test: add(x, 0.5) is off by {err:.3g} relative (tolerance 2e-3)")
