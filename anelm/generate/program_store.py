"""Generation programs found before they are built: a recipe key -> the compiled program.

A warm `anelm generate` used to rebuild every layer program (graph, passes, codegen, blob
encoding, the content key's hash over every blob) only to find its plan in the kernel store.
This store is asked first, by a key over what determines the program (`recipe_key`):

  - the code that builds it: a fingerprint of the whole anelm package's source files (simple
    and safe: an edit anywhere makes every entry a miss, rebuilt and rewritten);
  - the recipe: kind, size, layer shape, adapter slots, columns, the chip profile's
    behaviours and the inputs of the rope tables (the caller's `parts`);
  - the layer's weights, by digest (`LayerBlobs`, hashed once per layer per process); an int8
    linear (`kernels.int8.QLinear`, its q blob-backed) by its int8 file and its small fields.

An entry (in `cache_dir("programs")`, a `device.disk_cache.DiskCache`: bounded like the
kernel store, safe for concurrent processes, a damaged entry is a miss) holds the MIL text,
the signature, the meta, the program's content key, and for every BLOBFILE path where its
bytes come from: one of the layer's weight files, by digest, or for a small derived const
(masks, rope tables, biases) the bytes themselves. It holds no copy of the weights: a hit
serves the runner's own blob-backed weights (`mil.blob.blob_backed`) as the blobs, so the
emulator replays its plan over views of them, and the real ANE gets the same bytes the build
would have made. A program with a large blob that is none of the layer's weights gets no
entry: it builds as before.

Digests are xxHash's XXH3-128: a local cache key, not a security boundary, so speed decides
(7 GB/s here against sha256's 1.34 GB/s: 30 ms instead of 160 ms over SmolLM2's 212 MB of
layer weights), and 128 bits keep an accidental collision, which would silently run the wrong
weights, out of reach.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any, Callable

import numpy as np
import xxhash

from ..caches import cache_dir, source_fingerprint
from ..compiler.artifact import Artifact, Signature
from ..compiler.passes.validate import sram_notice
from ..device.disk_cache import DiskCache
from ..kernels.qlinear import QLinear
from ..mil.blob import backing_file

FORMAT = 1  # the entry's layout: a change makes older entries misses, rebuilt and rewritten
SMALL_BLOB = 1 << 20  # a blob under this many bytes that no weight matches is stored as it is
_LENGTH = struct.Struct("<Q")  # the JSON header's length, before it


def digest(data) -> str:
    """XXH3-128 of a bytes-like object, as hex (module doc: why this hash)."""
    return xxhash.xxh3_128_hexdigest(data)


class LayerBlobs:
    """One layer's weights as the blobs its programs are built from: every weight file by
    digest, and one digest over the whole layer; None (`of`) when a weight is not blob-backed."""

    def __init__(self, files: dict[str, memoryview], layer_digest: str):
        self.files, self.digest = files, layer_digest
        self._by_memory = {_memory(f): d for d, f in files.items()}

    def digest_of(self, blob) -> str:
        """The digest of a program's blob: a weight file's is known (the blob is that memory, and
        the file is read-only), any other blob is hashed."""
        return self._by_memory.get(_memory(blob)) or digest(blob)

    @classmethod
    def of(cls, layer: dict[str, tuple[Any, Any]]) -> "LayerBlobs | None":
        files, h = {}, xxhash.xxh3_128()
        for name in sorted(layer):
            for part, a in zip(("w", "b"), layer[name]):
                if a is None:
                    h.update(f"{name}.{part}=None;".encode())
                    continue
                if isinstance(a, QLinear):  # an int8 linear: its int8 file and its small fields
                    a, small = a.q, repr([(f, _field(getattr(a, f))) for f in _QFIELDS])
                    h.update(f"{name}.{part}.q8={small};".encode())
                if dataclasses.is_dataclass(a):  # 4-bit blocks or lookup tables: every field, no file
                    small = [_field(getattr(a, f.name)) for f in dataclasses.fields(a)]
                    h.update(f"{name}.{part}.{type(a).__name__}={small};".encode())
                    continue
                if not isinstance(a, np.ndarray):
                    return None  # anything else: those programs build as before
                file = backing_file(a, "fp16" if a.dtype != np.int8 else "int8") if part == "w" else None
                d = digest(file) if file is not None else digest(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                if file is not None:
                    files[d] = file
                h.update(f"{name}.{part}={a.dtype.str}{list(a.shape)}:{d};".encode())
        return cls(files, h.hexdigest())


_QFIELDS = ("scale", "shift", "act_scale", "keep", "keep_w", "in_gain")  # QLinear's fields besides q


def _field(v) -> str:
    """A QLinear field in the layer's digest: an array by dtype, shape and digest, else repr."""
    if isinstance(v, np.ndarray):
        return f"{v.dtype.str}{list(v.shape)}:{digest(np.ascontiguousarray(v).reshape(-1).view(np.uint8))}"
    return repr(v)


def _memory(buf) -> tuple[int, int]:
    """Where a buffer's bytes are: (address, length)."""
    a = np.frombuffer(buf, np.uint8)
    return a.__array_interface__["data"][0], a.nbytes


def recipe_key(parts: dict[str, Any], layer: LayerBlobs) -> str:
    """The store's key for a program: the code, the recipe `parts` (a JSON-able dict of what
    decides the program besides the weights) and the layer's weights."""
    text = json.dumps({"format": FORMAT, "code": source_fingerprint(), "layer": layer.digest, **parts},
                      sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def program_store() -> DiskCache:
    """The store's folder of the cache directory, bounded by `ANELM_KERNEL_CACHE_MB`."""
    return DiskCache(cache_dir("programs"), FORMAT)


def find_or_build(store: DiskCache, key: str, layer: LayerBlobs, build: Callable[[], Artifact],
                  profile) -> Artifact:
    """The stored program under `key`, its blobs served from `layer`; else `build()`, stored
    for next time when every blob can be named."""
    art = _load(store.get(key), layer, profile)
    if art is not None:
        return art
    art = build()
    payload = _dump(art, layer, profile)
    if payload is not None:
        store.put(key, payload)
    return art


def _dump(art: Artifact, layer: LayerBlobs, profile) -> bytes | None:
    """The entry of `art`: its text, signature, meta and key, and each blob's source."""
    blobs, inline = {}, []
    at = 0
    for path, blob in art.weights.items():
        d = layer.digest_of(blob)
        if d in layer.files:
            blobs[path] = {"weight": d}
        elif memoryview(blob).nbytes < SMALL_BLOB:
            n = memoryview(blob).nbytes
            blobs[path] = {"inline": [at, n]}
            inline.append(blob)
            at += n
        else:
            return None  # a large blob that is none of the layer's weights: no entry
    try:
        head = json.dumps({"mil": art.mil_text, "signature": art.signature.to_json(), "meta": art.meta,
                           "key": art.key(profile), "blobs": blobs}).encode()
    except (TypeError, ValueError):
        return None  # meta that JSON cannot hold: the program builds every time, as before
    if json.loads(head)["meta"] != art.meta:
        return None  # meta that JSON would change (tuples, non-string keys): a hit must give the same
    return b"".join([_LENGTH.pack(len(head)), head, *inline])


def _load(payload: bytes | None, layer: LayerBlobs, profile) -> Artifact | None:
    """The artifact of an entry, or None when there is none or it does not fit this layer."""
    if payload is None:
        return None
    try:
        (n,) = _LENGTH.unpack_from(payload)
        head = json.loads(payload[_LENGTH.size:_LENGTH.size + n])
        body = memoryview(payload)[_LENGTH.size + n:]
        weights = {}
        for path, src in head["blobs"].items():
            if "weight" in src:
                weights[path] = layer.files[src["weight"]]
            else:
                start, size = src["inline"]
                if start + size > body.nbytes:
                    return None
                weights[path] = body[start:start + size].toreadonly()
        art = Artifact(head["mil"], weights, Signature.from_json(head["signature"]), head["meta"])
        art = art.known_key(head["key"], profile)
    except Exception:  # noqa: BLE001 - an entry that does not read is a miss: rebuilt and rewritten
        return None
    if art.meta.get("sram"):
        sram_notice(art.meta["sram"])  # the notice its compile gave: the same program runs
    return art
