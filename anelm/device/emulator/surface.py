"""The emulator's surface: the same bytes as a hardware surface, with a float32 form of its fp16 words.

The emulator computes on float32 arrays that hold fp16 values (`fp16.round_fp16`). Converting
every input from fp16 bytes and every output back with numpy's float16 casts cost more than the
arithmetic, for weights passed as inputs most of all. This surface keeps whichever form was
written last and rebuilds the other only when someone asks for it: fp16 tensors written with
`write_half` and read by the emulator (and the reverse for outputs) are never cast at all.
Raw byte reads and writes still see exactly what a hardware surface would hold.
"""

from __future__ import annotations

import numpy as np

from ...fp16.grid import round_fp16
from ..base import Surface


class ShadowedSurface(Surface):
    host_half = np.dtype(np.float32)

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self._half: np.ndarray | None = None  # float32 values of the fp16 words, when current
        self._bytes_current = True
        self._pristine = True  # all zeros, never written
        self._shared = False  # _half was handed out by share_half: copy it before writing into it

    # --- the byte form (what hardware holds) ------------------------------------------------
    def write(self, data, offset: int = 0) -> None:
        self._sync_bytes()
        super().write(data, offset)
        self._half, self._pristine = None, False

    def read(self, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        self._sync_bytes()
        return super().read(nbytes, offset)

    def view(self) -> np.ndarray:
        self._sync_bytes()
        self._half, self._pristine = None, False  # the caller may change the bytes
        return self._buf

    # --- the value form ---------------------------------------------------------------------
    def write_half(self, values: np.ndarray, exact: bool = False) -> None:
        v = np.asarray(values).reshape(-1)
        half = self._writable_values()
        if v.size > half.size:
            raise ValueError(f"write of {2 * v.size} bytes at 0 overruns a {self.nbytes}-byte surface")
        half[: v.size] = v if exact else round_fp16(v)  # (fp16 input: round_fp16 only widens it)
        self._bytes_current = self._pristine = False

    def read_half(self, count: int) -> np.ndarray:
        return self.half_view(count).copy()

    def adopt_half(self, values: np.ndarray) -> bool:
        """Take `values` (a C-contiguous float32 array of fp16 values, as large as the surface,
        whose memory nobody else holds or writes) as the content, without a copy; False when it
        does not qualify and nothing was done. How the emulator hands results to output surfaces."""
        if not (isinstance(values, np.ndarray) and values.dtype == np.float32
                and values.flags.c_contiguous and values.size == self.nbytes // 2):
            return False
        self._half = values.reshape(-1)
        self._bytes_current = self._pristine = self._shared = False
        return True

    def share_half(self, count: int) -> np.ndarray:
        """The first `count` values without a copy: the surface's memory, as a hardware surface
        mapped on the host is, until the next write into the surface, which first copies its
        values (or replaces them, as `adopt_half` does), so the array handed out stays as it is."""
        view = self.half_view(count)
        self._shared = True
        return view

    def half_view(self, count: int) -> np.ndarray:
        """The first `count` values, live (the emulator reads inputs this way; do not modify)."""
        half = self._values()
        if count > half.size:
            raise ValueError(f"read of {2 * count} bytes at 0 overruns a {self.nbytes}-byte surface")
        return half[:count]

    def live_half(self, count: int) -> np.ndarray:
        """The first `count` values, live and writable: writes through it are writes to the surface
        (how a request stages weight columns in place). Ask again after any byte-level write."""
        half = self._writable_values()
        if count > half.size:
            raise ValueError(f"read of {2 * count} bytes at 0 overruns a {self.nbytes}-byte surface")
        self._bytes_current = self._pristine = False
        return half[:count]

    def release(self) -> None:
        super().release()
        self._half, self._bytes_current, self._shared = None, True, False

    def _values(self) -> np.ndarray:
        if self._half is None:
            n = self.nbytes // 2
            self._half = np.zeros(n, np.float32) if self._pristine else \
                self._buf[: 2 * n].view(np.float16).astype(np.float32)
        return self._half

    def _writable_values(self) -> np.ndarray:
        half = self._values()
        if self._shared:  # someone holds the current array: write into a copy
            self._half, self._shared = half.copy(), False
        return self._half

    def _sync_bytes(self) -> None:
        if not self._bytes_current:
            n = self._half.size
            self._buf[: 2 * n].view(np.float16)[:] = self._half  # exact values: the cast only repacks
            self._bytes_current = True
