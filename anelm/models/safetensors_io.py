"""safetensors files, read and written in one place: checkpoints, exported and quantized
folders, LoRA adapters, HF weights.

Layout (huggingface/safetensors): a little-endian u64 header length, a JSON header mapping
each tensor name to `{"dtype", "shape", "data_offsets"}` (plus `"__metadata__"`, a string to
string map), then the packed data. Reading goes through the `safetensors` package with
`framework="numpy"` (no torch), which validates the header; bf16, which numpy lacks, is
widened to float32 from the raw bytes. Writing streams tensor by tensor, so saving a model
never holds a second copy of it (`safetensors.numpy.save_file` builds the whole file in
memory), always through `atomic_open`: a temp file renamed into place.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Collection
from pathlib import Path

import numpy as np

from ..atomic import atomic_open
from ..errors import AnelmError

DTYPE_CODES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
               "uint32": "U32", "uint16": "U16", "uint8": "U8", "int8": "I8"}


class SafetensorsError(AnelmError):
    """A file that is not readable safetensors, or a tensor safetensors cannot hold. The
    message is the first line of the cause; callers say what they expected the file to be."""


def read_safetensors(path: str | os.PathLike, names: Collection[str] | None = None
                     ) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(metadata, tensors) of one file; only `names` when given (others are not read)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as st:
            meta = st.metadata() or {}
            keys = [k for k in st.keys() if names is None or k in names]
            bf16 = [k for k in keys if st.get_slice(k).get_dtype() == "BF16"]
            tensors = {k: st.get_tensor(k) for k in keys if k not in bf16}
        tensors.update(_read_bf16(path, bf16))
    except Exception as e:  # SafetensorError, OSError, ValueError: truncated, garbage, bad header
        raise SafetensorsError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return meta, tensors


def _read_bf16(path: Path, keys: list[str]) -> dict[str, np.ndarray]:
    # a bf16 value is the top half of the float32 with the same bits
    if not keys:
        return {}
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        out = {}
        for k in keys:
            start, end = header[k]["data_offsets"]
            fh.seek(8 + n + start)
            raw = np.frombuffer(fh.read(end - start), dtype="<u2")
            out[k] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(header[k]["shape"])
    return out


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
