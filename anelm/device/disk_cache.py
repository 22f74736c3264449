"""A bounded on-disk store of byte strings by content key, safe for concurrent processes.

    store = DiskCache(cache_dir("kernels"))     # the folder of docs/caching.md
    store.put(key, payload)                     # temp file + atomic rename, then trim to the bound
    store.get(key)                              # the payload, or None (absent, corrupt or stale)

Each entry is one file `<key>.v<format>.bin`: a header (magic, format version, the key, the
payload's length and its SHA-256), then the payload. An entry whose header, length or checksum
does not check out (a truncated write from a killed process on a filesystem without atomic
rename, a disk error) is deleted and reported as a miss, so the caller rebuilds and rewrites
it; another format's entries are other files, left to the bound's eviction. Two processes
filling the store at once each write a private temp file and rename it into place: a reader
sees a whole entry or none, and the last writer of one key wins with the same content. Use marks recency: a hit sets the file's modification time, and past
the bound (`ANELM_KERNEL_CACHE_MB`, default 2048; 0 turns the store off) the least recently
used entries are deleted first.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

from ..atomic import atomic_open
from ..errors import AnelmError

MAGIC = b"ANELMKC\x00"
HEADER = struct.Struct("<8sI64sQ32s")  # magic, format version, key (hex), payload length, sha256
SUFFIX = ".bin"
_KEY = re.compile("[0-9a-f]{64}")
DEFAULT_MB = 2048
ENV_LIMIT = "ANELM_KERNEL_CACHE_MB"


def limit_bytes() -> int:
    """The store's bound from `ANELM_KERNEL_CACHE_MB` (a whole number of MiB; 0 is off)."""
    text = os.environ.get(ENV_LIMIT, "").strip()
    if not text:
        return DEFAULT_MB << 20
    if not text.isdigit():
        raise AnelmError(f"{ENV_LIMIT}={text!r}: expected a whole number of megabytes (0 turns the "
                         f"kernel cache off; default {DEFAULT_MB})")
    return int(text) << 20


# Per folder, the total this process last found by listing it, plus what it has put since: a
# put that keeps this within the bound needs no listing (a stat per entry costs ~14 us here:
# 1.2 s over a cold 60-program model's puts into a folder of 500 entries). Processes filling
# one folder at once can each overshoot by what the others wrote since its last listing, until
# one of them lists it again; entries deleted or replaced meanwhile only make the count high.
_KNOWN: dict[Path, int] = {}


class DiskCache:
    """The store in one folder, for one entry format, within one bound."""

    def __init__(self, root: str | os.PathLike, version: int, limit: int | None = None):
        self.root, self.version = Path(root), version
        self.limit = limit_bytes() if limit is None else limit

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def path(self, key: str) -> Path:
        if _KEY.fullmatch(key) is None:
            raise ValueError(f"cache key {key!r}: expected 64 lowercase hex digits (a SHA-256)")
        # the format in the name: two versions of anelm sharing a cache folder keep their own
        # entries side by side instead of deleting each other's as damaged at every switch
        return self.root / f"{key}.v{self.version}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        """The payload stored under `key`, or None; a damaged entry is deleted on the way."""
        if not self.enabled:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        payload = self._checked(data, key)
        if payload is None:
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recency for the least-recently-used order
        except OSError:
            pass  # evicted by another process meanwhile: the payload read is whole anyway
        return payload

    def put(self, key: str, payload: bytes) -> None:
        """Store `payload` under `key` (atomically), then trim the store to its bound."""
        if not self.enabled:
            return
        path = self.path(key)
        header = self.header(key, payload)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with atomic_open(path) as f:
                f.write(header)
                f.write(payload)
        except OSError:
            return  # a read-only or full disk costs the cache, not the compile
        known, size = _KNOWN.get(self.root), len(header) + len(payload)
        if known is not None and known + size <= self.limit:
            _KNOWN[self.root] = known + size  # within the bound: no listing
        else:
            self.trim(keep=path)

    def header(self, key: str, payload: bytes) -> bytes:
        return HEADER.pack(MAGIC, self.version, key.encode(), len(payload), hashlib.sha256(payload).digest())

    def trim(self, keep: Path | None = None) -> None:
        """Delete least recently used entries until the total is within the bound (a put calls
        it when `_KNOWN` cannot rule that out). The folder is listed by `os.scandir`, names as
        plain strings: pathlib's glob and stat took twice as long."""
        entries, keep_name = [], keep.name if keep is not None else None
        try:
            listing = list(os.scandir(self.root))
        except OSError:
            return
        for e in listing:
            if not e.name.endswith(SUFFIX):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted by another process meanwhile
            entries.append((e.name == keep_name, st.st_mtime_ns, st.st_size, e.path))  # the new entry goes last
        total = sum(e[2] for e in entries)
        for _, _, size, path in sorted(entries):
            if total <= self.limit:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
        _KNOWN[self.root] = total

    def _checked(self, data: bytes, key: str) -> bytes | None:
        if len(data) < HEADER.size:
            return None
        magic, version, stored_key, length, digest = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        if magic != MAGIC or version != self.version or stored_key != key.encode() or length != len(payload):
            return None
        return payload if hashlib.sha256(payload).digest() == digest else None
