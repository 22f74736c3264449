"""BLOBFILE weights, byte for byte as coremltools' blob writer (storage version 2) lays them out.

    offset  size  field
    0       u32   number of tensors in the file
    4       u32   storage version, 2
    8..63         zero
    per tensor, at a 64-aligned offset (the MIL `offset = uint64(...)` points HERE):
    +0      u32   sentinel 0xDEADBEEF
    +4      u32   dtype code (DTYPE_CODES)
    +8      u64   payload size in bytes
    +16     u64   absolute file offset of the payload (64-aligned, right after this block)
    +24     u64   padding bits in the last payload byte (sub-byte dtypes only, else 0)
    +32..63       zero
    payload, row-major little-endian; the next metadata block starts at the next 64 boundary.

Sub-byte dtypes (int4, uint1..uint6) are packed LSB first, as coremltools packs them.
All integers are little-endian. One tensor per file is our default: M1 rejects files
with several chunks (the `single_chunk_blobs_only` profile switch).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import BlobError
from .program import NUMPY_DTYPES, SUBBYTE_BITS, int_range, storage_dtype

SENTINEL = 0xDEADBEEF
VERSION = 2
ALIGN = 64
HEADER = struct.Struct("<II")  # count, version
META = struct.Struct("<IIQQQ")  # sentinel, dtype code, size, data offset, padding bits

# Codes read back from files written by coremltools.libmilstoragepython._BlobStorageWriter
# (coremltools 9.0), one write_<type>_data call per dtype.
DTYPE_CODES = {
    "fp16": 1, "fp32": 2, "uint8": 3, "int8": 4, "int16": 6, "uint16": 7, "int4": 8,
    "uint1": 9, "uint2": 10, "uint4": 11, "uint3": 12, "uint6": 13, "int32": 14, "uint32": 15,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_BY_NUMPY = {np.dtype(NUMPY_DTYPES[k]): k for k in DTYPE_CODES if k in NUMPY_DTYPES}
_STORED = {k: np.dtype(NUMPY_DTYPES[k]).newbyteorder("<") for k in DTYPE_CODES if k in NUMPY_DTYPES}  # as laid out


class Chunk(NamedTuple):
    offset: int  # of the metadata block: the MIL offset
    dtype: str
    nbytes: int  # payload size


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_CODES:
        raise BlobError(f"dtype '{dtype}' cannot be stored in a BLOBFILE; expected one of {sorted(DTYPE_CODES)}")


def payload_size(dtype: str, count: int) -> int:
    """Bytes a payload of `count` elements of `dtype` takes."""
    _check_dtype(dtype)
    if dtype in SUBBYTE_BITS:
        return -(-count * SUBBYTE_BITS[dtype] // 8)
    return count * _STORED[dtype].itemsize


# --------------------------------------------------------------------------- encoding


def _infer_dtype(arr: np.ndarray) -> str:
    if arr.dtype not in _BY_NUMPY:
        raise BlobError(f"array dtype {arr.dtype} has no BLOBFILE code; expected one of {sorted(map(str, _BY_NUMPY))}")
    return _BY_NUMPY[arr.dtype]


def _pack_subbyte(arr: np.ndarray, dtype: str) -> bytes:
    bits, (lo, hi) = SUBBYTE_BITS[dtype], int_range(dtype)
    vals = np.asarray(arr).reshape(-1).astype(np.int64)
    if vals.size and (vals.min() < lo or vals.max() > hi):
        raise BlobError(f"{dtype} values must lie in [{lo}, {hi}]; found [{vals.min()}, {vals.max()}]")
    codes = vals & ((1 << bits) - 1)  # two's complement nibble for int4
    if bits == 4:  # two values a byte, the first in the low nibble: the bit planes' order, 20x faster
        pairs = np.zeros(2 * -(-codes.size // 2), np.uint8)
        pairs[:codes.size] = codes
        return (pairs[0::2] | (pairs[1::2] << 4)).tobytes()
    bitplane = (codes[:, None] >> np.arange(bits)) & 1  # (n, bits), LSB first
    return np.packbits(bitplane.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def pack_bits(d: np.ndarray, bits: int) -> np.ndarray:
    """Rows of `bits`-bit values [rows, cols] -> uint8 [rows, cols·bits/8], each row packed as
    `_pack_subbyte` packs a payload (LSB first): a folder's stored form of a BLOBFILE's bytes."""
    d = np.asarray(d, np.uint8)
    if bits == 4:  # nibble pairs, the earlier value low: the same bytes, 10x faster
        return (d[:, 0::2] | (d[:, 1::2] << 4)).astype(np.uint8)
    planes = (d[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(d.shape[0], -1), axis=1, bitorder="little")


def unpack_bits(p: np.ndarray, bits: int) -> np.ndarray:
    if bits == 4:
        return np.stack([p & 15, p >> 4], axis=2).reshape(p.shape[0], -1)
    planes = np.unpackbits(p, axis=1, bitorder="little").reshape(p.shape[0], -1, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)


def _payload(arr: np.ndarray, dtype: str) -> bytes | memoryview:
    """The stored bytes: a view of `arr` itself when it already is little-endian C-contiguous."""
    if dtype in SUBBYTE_BITS:
        return _pack_subbyte(arr, dtype)
    a = np.ascontiguousarray(arr, dtype=np.dtype(NUMPY_DTYPES[dtype]).newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))


def _file_header(count: int) -> bytes:
    return HEADER.pack(count, VERSION).ljust(ALIGN, b"\0")


def _meta_block(dtype: str, size: int, meta_at: int, pad_bits: int = 0) -> bytes:
    return META.pack(SENTINEL, DTYPE_CODES[dtype], size, meta_at + ALIGN, pad_bits).ljust(ALIGN, b"\0")


def encode_blob(arrays: Sequence[np.ndarray], dtypes: Sequence[str | None] | None = None) -> tuple[bytes, list[int]]:
    """One BLOBFILE holding `arrays` in order; returns the bytes and each MIL offset.

    `dtypes` names the stored MIL dtype per array (needed for sub-byte types, whose values
    come in int8/uint8 arrays); by default it follows the array's numpy dtype.
    """
    dtypes = list(dtypes) if dtypes is not None else [None] * len(arrays)
    if len(dtypes) != len(arrays):
        raise BlobError(f"encode_blob got {len(arrays)} arrays but {len(dtypes)} dtypes; expected one per array")
    parts, offsets, end = [_file_header(len(arrays))], [], ALIGN
    for arr, dtype in zip(arrays, dtypes):
        arr = np.asarray(arr)
        dtype = dtype or _infer_dtype(arr)
        _check_dtype(dtype)
        data = _payload(arr, dtype)
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        pad_bits = size * 8 - arr.size * SUBBYTE_BITS[dtype] if dtype in SUBBYTE_BITS else 0
        meta_at = _align(end)
        parts += [b"\0" * (meta_at - end), _meta_block(dtype, size, meta_at, pad_bits), data]
        offsets.append(meta_at)
        end = meta_at + ALIGN + size
    return b"".join(parts), offsets  # the one copy of each payload


def encode_tensor(arr: np.ndarray, dtype: str | None = None) -> bytes | memoryview:
    """A single-tensor BLOBFILE; its MIL offset is 64. An array made by `blob_backed` (or a
    view of one with its bytes in place, as a reshape is) is already such a file: the result is
    a read-only view of it, no copy."""
    arr = np.asarray(arr)
    found = backing_file(arr, dtype or _BY_NUMPY.get(arr.dtype))
    return found if found is not None else encode_blob([arr], [dtype])[0]


# --------------------------------------------------------------------------- blob-backed arrays
# A runner's weights and the blobs its programs hold are one memory: each weight lives as the
# payload of its own single-tensor BLOBFILE (fresh memory costs ~1.2 ns a byte on the VM this
# was measured on, and a copy of SmolLM2's layers is 212 MB).

SINGLE_PAYLOAD_AT = 2 * ALIGN  # a single-tensor file: file header, metadata block, payload


def single_header(dtype: str, size: int) -> bytes:
    """The 128 bytes before the payload of a single-tensor BLOBFILE (what `encode_tensor` writes)."""
    return _file_header(1) + _meta_block(dtype, size, ALIGN)


def blob_payload(shape: Sequence[int], dtype: str = "fp16") -> np.ndarray:
    """A new single-tensor BLOBFILE buffer, header written, as its writable payload of `shape`
    (a byte-sized `dtype`): fill it, then `seal` it, and `encode_tensor` of it is that file."""
    _check_dtype(dtype)
    if dtype in SUBBYTE_BITS:
        raise BlobError(f"a blob payload holds byte-sized dtypes; {dtype} is packed")
    shape = tuple(int(d) for d in shape)
    size = payload_size(dtype, int(np.prod(shape)))
    file = np.empty(SINGLE_PAYLOAD_AT + size, np.uint8)
    file[:SINGLE_PAYLOAD_AT] = np.frombuffer(single_header(dtype, size), np.uint8)
    return file[SINGLE_PAYLOAD_AT:].view(np.dtype(NUMPY_DTYPES[dtype]).newbyteorder("<")).reshape(shape)


def seal(payload: np.ndarray) -> np.ndarray:
    """A filled `blob_payload`, read-only from now on (its file too, so its blobs can be views)."""
    payload.base.flags.writeable = False
    payload.flags.writeable = False
    return payload


def blob_backed(arr: np.ndarray, dtype: str = "fp16") -> np.ndarray:
    """`arr` as `dtype` (a byte-sized one), read-only, stored as the payload of a single-tensor
    BLOBFILE buffer: `encode_tensor` of the result (or of a reshape of it) is that file."""
    from ..fp16.bits import to_half  # noqa: PLC0415 - numba loads with the first conversion

    arr = np.asarray(arr)
    out = blob_payload(arr.shape, dtype)
    if dtype == "fp16" and arr.dtype == np.float32:
        to_half(arr, out=out)
    else:
        np.copyto(out, arr, casting="unsafe")
    return seal(out)


def backing_file(arr: np.ndarray, dtype: str | None) -> memoryview | None:
    """The whole single-tensor BLOBFILE whose payload `arr` is (`blob_backed`), as a read-only
    view, or None when `arr` is not one (another dtype, another layout, a writable buffer)."""
    if dtype is None or dtype in SUBBYTE_BITS or dtype not in DTYPE_CODES or arr.dtype.byteorder == ">":
        return None
    file = arr
    while isinstance(file, np.ndarray) and file.base is not None:
        file = file.base
    if not (isinstance(file, np.ndarray) and file.dtype == np.uint8 and file.ndim == 1) or file.flags.writeable:
        return None
    if arr.dtype != np.dtype(NUMPY_DTYPES[dtype]) or not arr.flags.c_contiguous \
            or file.nbytes != SINGLE_PAYLOAD_AT + arr.nbytes \
            or arr.__array_interface__["data"][0] != file.__array_interface__["data"][0] + SINGLE_PAYLOAD_AT:
        return None
    if file[:SINGLE_PAYLOAD_AT].tobytes() != single_header(dtype, arr.nbytes):
        return None
    return memoryview(file)


def frozen(blob) -> bytes | memoryview:
    """A blob that cannot change under its reader: bytes as they are, a read-only view as it is
    (its owner's promise, as `blob_backed` buffers keep it), anything else copied."""
    if isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly):
        return blob
    return bytes(blob)


# --------------------------------------------------------------------------- decoding


def _read_meta(data: bytes, offset: int, source: str) -> tuple[int, int, int]:
    """Validate the metadata block at `offset`; returns (dtype code, size, data offset)."""
    if offset < 0 or offset + META.size > len(data):
        raise BlobError(f"{source}: offset {offset} is past the end of a {len(data)}-byte blob; "
                        "expected the offset of a 64-byte metadata block")
    sentinel, code, size, data_at, _ = META.unpack_from(data, offset)
    if sentinel != SENTINEL:
        raise BlobError(f"{source}: no blob metadata at offset {offset}: expected sentinel 0xDEADBEEF, "
                        f"found 0x{sentinel:08X} (wrong offset?)")
    if data_at + size > len(data):
        raise BlobError(f"{source}: truncated: the tensor at offset {offset} needs bytes "
                        f"[{data_at}, {data_at + size}) but the blob has {len(data)}")
    return code, size, data_at


def _unpack_subbyte(raw: bytes, dtype: str, count: int) -> np.ndarray:
    bits = SUBBYTE_BITS[dtype]
    if bits == 4:  # the low nibble first (`_pack_subbyte`)
        b = np.frombuffer(raw, np.uint8)
        vals = np.empty(2 * b.size, np.int16)
        vals[0::2], vals[1::2] = b & 15, b >> 4
        vals = vals[:count]
        if dtype == "int4":
            vals = np.where(vals >= 8, vals - 16, vals)
        return vals.astype(storage_dtype(dtype))
    flat = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[: count * bits]
    vals = flat.reshape(count, bits).astype(np.int16) @ (1 << np.arange(bits, dtype=np.int16))
    if dtype == "int4":
        vals = np.where(vals >= 8, vals - 16, vals)  # sign-extend the nibble
    return vals.astype(storage_dtype(dtype))


def decode_blob(data: bytes, offset: int, dtype: str, shape: Sequence[int] | None, source: str = "blob") -> np.ndarray:
    """The tensor whose metadata block sits at `offset`, checked against the MIL `dtype` and `shape`.

    Byte-sized dtypes come back as a read-only view of `data`; sub-byte ones unpacked into
    an int8/uint8 array.
    """
    _check_dtype(dtype)
    shape = tuple(shape or ())
    code, size, data_at = _read_meta(data, offset, source)
    if code != DTYPE_CODES[dtype]:
        found = CODE_DTYPES.get(code, "unknown")
        raise BlobError(f"{source}: dtype mismatch at offset {offset}: the MIL says {dtype} "
                        f"(code {DTYPE_CODES[dtype]}), the blob holds code {code} ({found})")
    count = math.prod(map(int, shape))
    want = payload_size(dtype, count)
    if size != want:
        raise BlobError(f"{source}: size mismatch at offset {offset}: {dtype}{list(shape)} needs "
                        f"{want} bytes, the blob holds {size}")
    raw = memoryview(data)[data_at : data_at + size]
    if dtype in SUBBYTE_BITS:
        return _unpack_subbyte(bytes(raw), dtype, count).reshape(shape)
    return np.frombuffer(raw, _STORED[dtype]).reshape(shape)


def blob_chunks(data: bytes, source: str = "blob") -> list[Chunk]:
    """Every tensor in a BLOBFILE, in file order, walking from the header's count."""
    if len(data) < ALIGN:
        raise BlobError(f"{source}: truncated: {len(data)} bytes, expected at least the 64-byte file header")
    count, version = HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise BlobError(f"{source}: storage version {version}, expected {VERSION}")
    chunks, at = [], ALIGN
    for _ in range(count):
        code, size, data_at = _read_meta(data, at, source)
        if code not in CODE_DTYPES:
            raise BlobError(f"{source}: unknown dtype code {code} at offset {at}; "
                            f"expected one of {sorted(CODE_DTYPES)}")
        chunks.append(Chunk(at, CODE_DTYPES[code], size))
        at = _align(data_at + size)
    return chunks
