"""The low-level device interface, mirroring the private API's life cycle.

    model = device.compile(mil_text, weights)   # _ANEInMemoryModel ... compileWithQoS
    device.load(model)                          # loadWithQoS
    device.evaluate(model, inputs, outputs)     # _ANERequest + evaluateWithQoS
    device.unload(model)                        # unloadWithQoS

`weights` maps the MIL path (`@model_path/weights/wq.bin`) to the whole BLOBFILE bytes.
Surfaces are flat byte buffers (IOSurfaces on hardware) bound by position: the runtime
orders them as the chip profile says (alphabetically by MIL name in `strict`).

The real ANE backend and the emulator both implement this, so everything above it
(runtime, kernels, models, training) runs unchanged on either.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import numpy as np

from ..chip.profile import ChipProfile
from ..errors import CompileBudgetExceeded

_count_lock = threading.Lock()
_compile_count = 0  # per process, across every device instance, as the hardware leak is


def compile_count() -> int:
    return _compile_count


def charge_compile(budget: int) -> int:
    """Count one compile against the per-process budget; raise once it is spent."""
    global _compile_count
    with _count_lock:
        if _compile_count >= budget:
            raise CompileBudgetExceeded(
                f"compile budget of {budget} compiles per process is spent; "
                "restart the process (the trainer re-executes itself) or use the dynamic pipeline"
            )
        _compile_count += 1
        return _compile_count


def reset_compile_count() -> None:
    """For tests only: a fresh process starts at zero."""
    global _compile_count
    with _count_lock:
        _compile_count = 0


class Surface:
    """A flat byte buffer that the device reads and writes; an IOSurface on hardware.

    Data is written and read packed from byte 0; the allocation may be larger than the
    tensor it carries (uniform sizes, minimum allocation).
    """

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self._buf = np.zeros(self.nbytes, dtype=np.uint8)

    def write(self, data: bytes | np.ndarray, offset: int = 0) -> None:
        raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset < 0 or offset + raw.size > self.nbytes:
            raise ValueError(f"write of {raw.size} bytes at {offset} overruns a {self.nbytes}-byte surface")
        self._buf[offset:offset + raw.size] = raw

    def read(self, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """A copy of `nbytes` bytes from `offset` as uint8."""
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"read of {n} bytes at {offset} overruns a {self.nbytes}-byte surface")
        return self._buf[offset:offset + n].copy()

    def view(self) -> np.ndarray:
        """The live bytes (emulator only; hardware surfaces must be locked to touch)."""
        return self._buf

    # fp16 tensors packed at offset 0: how the runtime moves activations and weights
    host_half = np.dtype(np.float16)  # the dtype host-side copies of this surface's fp16 data keep

    def write_half(self, values: np.ndarray, exact: bool = False) -> None:
        """Write a float tensor as fp16 from byte 0, rounding to nearest (overflow gives +-inf).

        `exact` promises every value already is an fp16 value; surfaces that keep float32
        values (the emulator's) then skip the rounding.
        """
        with np.errstate(over="ignore"):
            self.write(np.ascontiguousarray(values, dtype=np.float16))

    def read_half(self, count: int) -> np.ndarray:
        """The first `count` fp16 values, as a new float32 array."""
        return self.read(2 * count).view(np.float16).astype(np.float32)

    def share_half(self, count: int) -> np.ndarray:
        """The first `count` fp16 values as float32, for a caller that only reads them: here a
        new array; a surface that already holds float32 values may hand them out uncopied."""
        return self.read_half(count)

    def release(self) -> None:
        self._buf = np.zeros(0, dtype=np.uint8)
        self.nbytes = 0


class Device(ABC):
    """One execution target: the real ANE or the emulator."""

    name: str = "device"

    def __init__(self, profile: ChipProfile):
        self.profile = profile

    def new_surface(self, nbytes: int) -> Surface:
        return Surface(nbytes)

    @property
    def host_half(self) -> np.dtype:
        """The dtype host copies of fp16 data are best kept in for this device's surfaces."""
        return Surface.host_half

    @abstractmethod
    def compile(self, mil_text: str, weights: dict[str, bytes], key: str | None = None):
        """Compile MIL text with its weight blobs. A cold compile counts against the compile
        budget; a program served from a cache (the emulator's on-disk one, aned's on a Mac) is
        loaded, not compiled. `key`: the caller's `compiler.artifact.content_key` of exactly
        these (text, blobs, this device's profile), which spares hashing them again."""

    @abstractmethod
    def load(self, model) -> None: ...

    @abstractmethod
    def evaluate(self, model, inputs: list[Surface], outputs: list[Surface], watch: bool = False,
                 read_columns: int | None = None, batched: bool = False, only: tuple[str, ...] | None = None):
        """Run once. Surfaces bind by position in the profile's binding order.

        With `watch`, returns an `overflow.Overflow` naming where a result first came out inf
        or NaN from finite inputs (docs/chip-profiles.md), or None; without, always None (no cost).
        `read_columns` = n promises that the caller reads only the first n spatial columns of
        every output (a decode token padded to 16 columns reads 1): a device may leave the
        others unwritten. The ANE computes every column anyway; the emulator skips the rest
        when the program is column-separable (`emulator.columns`). `batched` asks for every
        column in one pass (a caller that reads most of them: the emulator's one product over
        all columns beats one per column, its sums rounding as the full plan's do). `only`
        names the outputs the caller reads: the others may be left as they were (the emulator
        runs only the steps those need; the ANE runs the whole program).
        """

    @abstractmethod
    def unload(self, model) -> None: ...

    @abstractmethod
    def rewrite_weight(self, model, path: str, blob: bytes) -> None:
        """Overwrite a blob in the model's compile folder (the delta-reload experiment).

        Whether a later unload + load sees it is the profile's `reload_reads_new_weights`.
        """

    @property
    def compile_count(self) -> int:
        return compile_count()

    def close(self) -> None:
        """Release everything the device holds."""
