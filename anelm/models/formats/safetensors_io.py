"""safetensors files, read and written in one place: checkpoints, exported and quantized
folders, LoRA adapters, HF weights.

Layout (huggingface/safetensors): a little-endian u64 header length, a JSON header mapping
each tensor name to `{"dtype", "shape", "data_offsets"}` (plus `"__metadata__"`, a string to
string map), then the packed data. The `safetensors` package (`framework="numpy"`, no torch)
validates the header; the tensors are then views of one copy-on-write map of the file, as
llama.cpp and torch's loaders map theirs: reading a model costs no second copy of it (the
package's `get_tensor` copies each tensor out of its map, which doubled a load's peak memory),
pages are read as they are first touched, a tensor written in place (an optimizer step) gets
private pages with the file unchanged, and the pages of a tensor whose array is dropped (a
weight converted to fp16 for the device) are handed back. A file rewritten in place while
mapped would change the pages not yet read: anelm's writers replace files by rename
(`atomic_open`), which leaves a mapped file as it was. bf16, which numpy lacks, is widened to
float32. Writing streams tensor by tensor, so saving a model never holds a second copy of it
(`safetensors.numpy.save_file` builds the whole file in memory), always through `atomic_open`:
a temp file renamed into place.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Collection
from pathlib import Path

import numpy as np

from ...atomic import atomic_open
from ...errors import AnelmError

DTYPE_CODES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
               "uint32": "U32", "uint16": "U16", "uint8": "U8", "int8": "I8"}


class SafetensorsError(AnelmError):
    """A file that is not readable safetensors, or a tensor safetensors cannot hold. The
    message is the first line of the cause; callers say what they expected the file to be."""


def read_safetensors(path: str | os.PathLike, names: Collection[str] | None = None
                     ) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(metadata, tensors) of one file; only `names` when given (others are not read). The
    tensors are writable views of a copy-on-write map of the file (module doc)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as st:  # the reference checks of the header
            meta = st.metadata() or {}
            keys = [k for k in st.keys() if names is None or k in names]
        tensors = _mapped(path, keys)
    except SafetensorsError:
        raise
    except Exception as e:  # SafetensorError, OSError, ValueError: truncated, garbage, bad header
        raise SafetensorsError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return meta, tensors


NUMPY_DTYPES = {code: np.dtype(name).newbyteorder("<") for name, code in DTYPE_CODES.items()} | {
    "I16": np.dtype("<i2"), "U64": np.dtype("<u8"), "BOOL": np.dtype(bool)}


def _mapped(path: Path, keys: list[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        if not keys:
            return out
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # one map (one descriptor) per file
    for k in keys:
        info = header[k]
        start, end = (8 + n + o for o in info["data_offsets"])
        code, shape = info["dtype"], tuple(info["shape"])
        dtype = np.dtype("<u2") if code == "BF16" else NUMPY_DTYPES.get(code)
        if dtype is None:
            raise SafetensorsError(f"tensor {k}: dtype {code} has no numpy type; expected one of "
                                   f"{sorted(NUMPY_DTYPES) + ['BF16']}")
        count = (end - start) // dtype.itemsize
        a = np.frombuffer(data, dtype, count, start) if count else np.zeros(0, dtype)
        if count:
            weakref.finalize(a, _release, data, start, end)
        # a bf16 value is the top half of the float32 with the same bits
        out[k] = ((a.astype(np.uint32) << 16).view(np.float32) if code == "BF16" else a).reshape(shape)
    return out


def _release(data: mmap.mmap, start: int, end: int) -> None:
    """A tensor's array is gone (a weight copied into another form, or dropped): return the
    pages that lie wholly inside its bytes, so a model read once and converted does not stay
    resident twice. Nothing can read those bytes any more, so private pages may go too."""
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first and hasattr(mmap, "MADV_DONTNEED"):
        try:
            data.madvise(mmap.MADV_DONTNEED, first, last - first)
        except (ValueError, OSError):
            pass  # the map is closed already, or the system keeps the pages: memory, not data


def save_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                     metadata: dict[str, str] | None = None, durable: bool = False) -> Path:
    """Write `tensors` atomically; `durable` also fsyncs file and folder."""
    path = Path(path)
    arrays, header = _layout(tensors, metadata or {})
    with atomic_open(path, durable=durable) as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for a in arrays:
            _write_array(f, a)
    return path


def _write_array(f, a: np.ndarray) -> None:
    if a.nbytes:
        f.write(memoryview(a.reshape(-1)).cast("B"))


def _layout(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[list[np.ndarray], bytes]:
    header: dict = {"__metadata__": metadata} if metadata else {}
    arrays, offset = [], 0
    # widest items first (stable), so every tensor starts aligned to its item size, as the
    # reference writer orders them: torch's reader needs aligned data
    for name, a in sorted(tensors.items(), key=lambda kv: -np.asarray(kv[1]).dtype.itemsize):
        a = np.ascontiguousarray(a).reshape(np.shape(a))  # ascontiguousarray makes a scalar 1-d
        if a.dtype.name not in DTYPE_CODES:
            raise SafetensorsError(f"tensor {name}: expected one of {sorted(DTYPE_CODES)}, got {a.dtype}")
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": DTYPE_CODES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    return arrays, blob + b" " * (-len(blob) % 8)  # data starts 8-aligned, as the reference writer does
