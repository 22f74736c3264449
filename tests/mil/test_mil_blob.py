"""BLOBFILE against its independent oracle: coremltools' own blob writer and reader.

Byte layout (docs/architecture.md) is also checked against hand-computed bytes.
"""

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anelm.errors import BlobError
from anelm.mil.blob import (DTYPE_CODES, Chunk, backing_file, blob_backed, blob_chunks, blob_payload, decode_blob,
                             encode_blob, encode_tensor, frozen, seal)

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
milstorage = pytest.importorskip("coremltools.libmilstoragepython")

# MIL dtype -> (coremltools method suffix, numpy container coremltools takes/returns)
CT = {
    "fp16": ("fp16", np.uint16), "fp32": ("float", np.float32), "int8": ("int8", np.int8),
    "uint8": ("uint8", np.uint8), "int16": ("int16", np.int16), "uint16": ("uint16", np.uint16),
    "int32": ("int32", np.int32), "uint32": ("uint32", np.uint32), "int4": ("int4", np.int8),
    "uint1": ("uint1", np.uint8), "uint2": ("uint2", np.uint8), "uint3": ("uint3", np.uint8),
    "uint4": ("uint4", np.uint8), "uint6": ("uint6", np.uint8),
}
SUBBYTE_RANGE = {"int4": (-8, 7), "uint1": (0, 1), "uint2": (0, 3), "uint3": (0, 7), "uint4": (0, 15), "uint6": (0, 63)}


def sample(dtype: str, n: int, seed: int = 0) -> np.ndarray:
    """Values of `dtype` in the container our API uses (float16 for fp16, int8/uint8 for sub-byte)."""
    rng = np.random.default_rng(seed)
    if dtype in ("fp16", "fp32"):
        return rng.standard_normal(n).astype(np.float16 if dtype == "fp16" else np.float32)
    if dtype in SUBBYTE_RANGE:
        lo, hi = SUBBYTE_RANGE[dtype]
        return rng.integers(lo, hi + 1, n).astype(CT[dtype][1])
    info = np.iinfo(CT[dtype][1])
    return rng.integers(info.min, info.max, n, endpoint=True).astype(CT[dtype][1])


def ct_write(path: Path, arrays: list[tuple[str, np.ndarray]]) -> list[int]:
    writer = milstorage._BlobStorageWriter(str(path))
    offsets = []
    for dtype, arr in arrays:
        suffix, container = CT[dtype]
        data = arr.view(np.uint16) if dtype == "fp16" else arr.astype(container)
        offsets.append(getattr(writer, f"write_{suffix}_data")(np.ascontiguousarray(data.reshape(-1))))
    del writer  # the writer flushes and closes on destruction
    return offsets


def ct_read(path: Path, dtype: str, offset: int) -> np.ndarray:
    out = getattr(milstorage._BlobStorageReader(str(path)), f"read_{CT[dtype][0]}_data")(offset)
    return np.asarray(out).view(np.float16) if dtype == "fp16" else np.asarray(out)


# ----------------------------------------------------------------------------- layout


def test_single_fp16_tensor_bytes_are_hand_computed():
    blob = encode_tensor(np.array([1.0, -2.0], np.float16))
    header = struct.pack("<II", 1, 2) + bytes(56)
    meta = bytes.fromhex("efbeadde" "01000000") + struct.pack("<QQ", 4, 128) + bytes(40)
    assert blob == header + meta + bytes.fromhex("003c00c0")  # 1.0 = 0x3c00, -2.0 = 0xc000


def test_multi_tensor_offsets_are_64_aligned():
    blob, offsets = encode_blob([np.zeros(3, np.float16), np.zeros(5, np.int8)])
    assert offsets == [64, 192]  # second block: after 128 + 6 data bytes, rounded up to 64
    assert struct.unpack_from("<II", blob, 0) == (2, 2)
    assert struct.unpack_from("<IIQQ", blob, 192) == (0xDEADBEEF, 4, 5, 256)


@pytest.mark.parametrize("dtype", sorted(CT))
def test_dtype_codes_are_what_coremltools_writes(tmp_path, dtype):
    ct_write(tmp_path / "b.bin", [(dtype, sample(dtype, 3))])
    code = struct.unpack_from("<I", (tmp_path / "b.bin").read_bytes(), 68)[0]
    assert DTYPE_CODES[dtype] == code


# ----------------------------------------------------------------------------- against coremltools


@pytest.mark.parametrize("dtype", sorted(CT))
def test_coremltools_reads_our_blobs(tmp_path, dtype):
    arrays = [sample(dtype, 37, seed=1), sample(dtype, 5, seed=2)]
    blob, offsets = encode_blob(arrays, [dtype, dtype])
    (tmp_path / "w.bin").write_bytes(blob)
    for arr, off in zip(arrays, offsets):
        np.testing.assert_array_equal(ct_read(tmp_path / "w.bin", dtype, off), arr)


@pytest.mark.parametrize("dtype", sorted(CT))
def test_our_bytes_equal_coremltools_bytes(tmp_path, dtype):
    arr = sample(dtype, 11, seed=3)
    ct_write(tmp_path / "ct.bin", [(dtype, arr)])
    assert encode_tensor(arr, dtype) == (tmp_path / "ct.bin").read_bytes()


def test_we_read_coremltools_multi_tensor_files(tmp_path):
    items = [("fp16", sample("fp16", 70)), ("int8", sample("int8", 5)), ("fp32", sample("fp32", 9)),
             ("uint4", sample("uint4", 13)), ("int32", sample("int32", 2))]
    offsets = ct_write(tmp_path / "m.bin", items)
    data = (tmp_path / "m.bin").read_bytes()
    assert blob_chunks(data) == [Chunk(o, d, len(encode_tensor(a, d)) - 128) for o, (d, a) in zip(offsets, items)]
    for off, (dtype, arr) in zip(offsets, items):
        np.testing.assert_array_equal(decode_blob(data, off, dtype, arr.shape), arr)
    assert encode_blob([a for _, a in items], [d for d, _ in items]) == (data, offsets)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(sorted(CT)), shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       seed=st.integers(0, 2**16))
def test_round_trip_any_dtype_and_shape(dtype, shape, seed):
    arr = sample(dtype, int(np.prod(shape)), seed).reshape(shape)
    got = decode_blob(encode_tensor(arr, dtype), 64, dtype, shape)
    assert got.shape == tuple(shape)
    np.testing.assert_array_equal(got, arr)


def test_conformance_weights_decode():
    root = SHARED / "data" / "mil-conformance"
    if not root.exists():
        pytest.skip("../shared absent: external fixtures are not part of a user's clone")
    mask_file = root / "causal_attention_decomposed" / "weights" / "mask.bin"
    mask = decode_blob(mask_file.read_bytes(), 64, "fp16", (1, 1, 64, 64))[0, 0]
    upper = np.triu(np.ones((64, 64), bool), 1)
    assert (mask[~upper] == 0).all() and (mask[upper] <= -1e4).all()  # causal: query row sees keys <= row
    for name in ("w1", "w3"):
        path = root / "swiglu_three_outputs" / "weights" / f"{name}.bin"
        assert blob_chunks(path.read_bytes()) == [Chunk(64, "fp16", 128 * 64 * 2)]
        w = decode_blob(path.read_bytes(), 64, "fp16", (128, 64, 1, 1))
        np.testing.assert_array_equal(w.reshape(-1), ct_read(path, "fp16", 64))


# ----------------------------------------------------------------------------- corrupt input


@pytest.fixture
def fp16_blob():
    return encode_tensor(np.arange(6, dtype=np.float16))


def test_wrong_offset_names_the_sentinel(fp16_blob):
    with pytest.raises(BlobError, match=r"offset 0.*0xDEADBEEF.*found 0x00000001"):
        decode_blob(fp16_blob, 0, "fp16", (6,))
    with pytest.raises(BlobError, match="offset 4096 is past the end"):
        decode_blob(fp16_blob, 4096, "fp16", (6,))


def test_truncated_file(fp16_blob):
    with pytest.raises(BlobError, match=r"truncated.*\[128, 140\).*139"):
        decode_blob(fp16_blob[:-1], 64, "fp16", (6,))
    with pytest.raises(BlobError, match="truncated"):
        blob_chunks(fp16_blob[:40])


def test_dtype_mismatch(fp16_blob):
    with pytest.raises(BlobError, match=r"dtype mismatch.*says int8 \(code 4\).*code 1 \(fp16\)"):
        decode_blob(fp16_blob, 64, "int8", (12,))


def test_size_mismatch(fp16_blob):
    with pytest.raises(BlobError, match=r"size mismatch.*fp16\[2, 4\] needs 16 bytes.*holds 12"):
        decode_blob(fp16_blob, 64, "fp16", (2, 4))


def test_bad_version_and_unknown_dtype(fp16_blob):
    with pytest.raises(BlobError, match="version 3, expected 2"):
        blob_chunks(fp16_blob[:4] + struct.pack("<I", 3) + fp16_blob[8:])
    with pytest.raises(BlobError, match="unknown dtype code 99"):
        blob_chunks(fp16_blob[:68] + struct.pack("<I", 99) + fp16_blob[72:])
    with pytest.raises(BlobError, match="dtype 'bool' cannot be stored"):
        decode_blob(fp16_blob, 64, "bool", (6,))
    with pytest.raises(BlobError, match="has no BLOBFILE code"):
        encode_tensor(np.zeros(2, np.bool_))


def test_subbyte_values_out_of_range():
    with pytest.raises(BlobError, match=r"int4 values must lie in \[-8, 7\]; found \[0, 9\]"):
        encode_tensor(np.array([0, 9], np.int8), "int4")


@pytest.mark.parametrize("src", [np.float32, np.float16])
def test_a_blob_backed_array_is_its_own_file_without_a_copy(src):
    """`blob_backed` keeps an array as the payload of its BLOBFILE: `encode_tensor` of it, or of a
    reshape of it, is a read-only view of that memory, byte for byte what encoding a plain copy
    writes (the oracle: the encoder's ordinary path, itself checked against coremltools above)."""
    a = np.random.default_rng(0).standard_normal((96, 700)).astype(src)  # past numba's size threshold
    held = blob_backed(a)
    assert held.dtype == np.float16 and not held.flags.writeable
    assert np.array_equal(held, a.astype(np.float16))
    plain = encode_tensor(np.array(held))  # a writable copy: the ordinary encoder
    for view in (held, held.reshape(96, 700, 1, 1)):
        blob = encode_tensor(view)
        assert isinstance(blob, memoryview) and blob.readonly
        assert np.shares_memory(np.frombuffer(blob, np.uint8), held)
        assert bytes(blob) == plain
        assert np.array_equal(decode_blob(blob, 64, "fp16", view.shape), view)


def test_only_an_untouched_blob_backed_array_is_served_as_its_file():
    held = blob_backed(np.ones((8, 8), np.float32))
    assert backing_file(held, "fp16") is not None
    assert backing_file(held[:4], "fp16") is None  # a part of the payload: not the whole file
    assert backing_file(held.T, "fp16") is None  # not C-contiguous
    assert backing_file(held, "int16") is None  # another dtype than the header says
    assert backing_file(np.ones((8, 8), np.float16), "fp16") is None  # a plain (writable) array
    assert isinstance(encode_tensor(held.T), bytes)  # encoded as before


def test_a_blob_payload_is_served_as_its_file_once_sealed():
    """A payload filled in place (as the fold writes the layer's weights) is a file like
    `blob_backed`'s, but only once sealed: while it can change, it is encoded as a copy."""
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    out = blob_payload(a.shape, "fp16")
    out[...] = a
    assert out.flags.writeable and backing_file(out, "fp16") is None
    assert seal(out) is out and not out.flags.writeable
    assert bytes(encode_tensor(out)) == bytes(encode_tensor(blob_backed(a))) == encode_tensor(np.array(out))
    assert isinstance(encode_tensor(out), memoryview)
    with pytest.raises(BlobError, match="byte-sized"):
        blob_payload((4,), "int4")


def test_frozen_copies_only_what_could_change():
    b = b"abc"
    view = memoryview(b)
    assert frozen(b) is b and frozen(view) is view
    mutable = bytearray(b"abc")
    snap = frozen(mutable)
    mutable[0] = 0
    assert snap == b"abc"
