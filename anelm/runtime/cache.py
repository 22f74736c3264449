"""The process-wide program cache: compiled programs by content, so nothing compiles twice.

Compiles are scarce (115 per process in `strict` on the ANE) and slow, so a Kernel asks the cache first.
The key is the artifact's content key (`compiler.artifact.content_key`: text, blobs, profile) plus
the device the program was compiled on (a compiled model belongs to one device). Entries stay compiled and loaded after their Kernel closes, for
the next Kernel of the same artifact; past `capacity`, the least recently used entry that no
live Kernel holds is evicted, which unloads it. `evict()` and `clear()` do the same on demand.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..device.base import Device

DEFAULT_CAPACITY = 32


@dataclass(eq=False)
class Entry:
    device: Device
    model: Any
    pins: int = 0  # live Kernels using the model; a pinned entry is never unloaded


class ProgramCache:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int], Entry] = OrderedDict()
        self._lock = threading.RLock()
        self.hits = self.misses = 0

    def acquire(self, artifact, device: Device) -> Any:
        """The loaded model for `artifact` on `device`, compiling on a miss; pins it."""
        key = (artifact.key(device.profile), id(device))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.device is device:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                model = device.compile(artifact.mil_text, artifact.weights, key=key[0])
                device.load(model)
                entry = self._entries[key] = Entry(device, model)
            entry.pins += 1
            self._shrink()
            return entry.model

    def release(self, model: Any) -> None:
        """A Kernel is done with `model`: unpin it (it stays cached until evicted)."""
        with self._lock:
            for entry in self._entries.values():
                if entry.model is model and entry.pins:
                    entry.pins -= 1
                    break
            self._shrink()

    def evict(self, artifact_key: str | None = None, device: Device | None = None) -> int:
        """Unload and drop unpinned entries (of one artifact and/or device); returns how many."""
        with self._lock:
            doomed = [k for k, e in self._entries.items() if e.pins == 0
                      and (artifact_key is None or k[0] == artifact_key)
                      and (device is None or e.device is device)]
            for k in doomed:
                self._drop(k)
            return len(doomed)

    def clear(self) -> int:
        return self.evict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, Device]) -> bool:
        art_key, device = key
        e = self._entries.get((art_key, id(device)))
        return e is not None and e.device is device

    def _shrink(self) -> None:
        # least recently used first; pinned entries are skipped, so the cap may be exceeded
        for k in [k for k, e in self._entries.items() if e.pins == 0]:
            if len(self._entries) <= self.capacity:
                break
            self._drop(k)

    def _drop(self, key: tuple[str, int]) -> None:
        entry = self._entries.pop(key)
        entry.device.unload(entry.model)


_CACHE = ProgramCache()


def program_cache() -> ProgramCache:
    """The process-wide cache every Kernel uses by default."""
    return _CACHE
