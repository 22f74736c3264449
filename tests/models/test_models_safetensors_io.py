"""The one safetensors reader and writer, against the reference implementation's."""

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from anelm.models.formats.safetensors_io import SafetensorsError, read_safetensors, save_safetensors


def mixed_tensors():
    rng = np.random.default_rng(0)
    return {"scalar": np.array(1.5, np.float32),  # a 0-d tensor stays 0-d
            "q": rng.integers(-128, 128, (3, 5)).astype(np.int8),  # 15 bytes: later data unaligned unless sorted
            "w": rng.standard_normal((4, 6)).astype(np.float32)[:, ::2],  # not contiguous
            "ids": np.array([1, 2, 3], np.int64), "h": rng.standard_normal(7).astype(np.float16)}


def test_written_file_reads_back_with_the_reference_reader_and_torch(tmp_path):
    torch_st = pytest.importorskip("safetensors.torch")
    t = mixed_tensors()
    path = save_safetensors(tmp_path / "m.safetensors", t, {"format": "pt"})
    meta, got = read_safetensors(path)
    ref = load_file(str(path))
    assert meta == {"format": "pt"}
    for k, a in t.items():
        for b in (got[k], ref[k]):
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(b, a)
    for k, b in torch_st.load_file(str(path)).items():  # torch's reader needs aligned data
        assert np.array_equal(b.numpy(), t[k])
    assert not list(tmp_path.glob(".*.tmp"))


def test_names_select_and_bf16_widens(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    x = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    save_torch({"x": x, "y": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    _, got = read_safetensors(tmp_path / "b.safetensors", {"x"})
    assert list(got) == ["x"] and got["x"].dtype == np.float32
    assert np.array_equal(got["x"], x.float().numpy())


def test_bad_files_and_dtypes_are_one_line_errors(tmp_path):
    p = tmp_path / "t.safetensors"
    save_file({"a": np.zeros(8, np.float32)}, str(p))
    p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(SafetensorsError) as e:
        read_safetensors(p)
    assert "\n" not in str(e.value)
    with pytest.raises(SafetensorsError, match="tensor c: expected one of"):
        save_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})
    assert not list(tmp_path.glob("c.safetensors*")) and not list(tmp_path.glob(".c.*"))


def test_tensors_are_copy_on_write_maps_of_the_file(tmp_path):
    """No second copy of a model: the tensors lie in a map of the file; writing one (an
    optimizer step) changes the process's copy only, and a file replaced by rename while mapped
    (how anelm writes checkpoints) leaves the mapped values as they were read."""
    import mmap

    path = tmp_path / "m.safetensors"
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    save_safetensors(path, {"w": w, "b": np.ones(3, np.float16)})
    _, got = read_safetensors(path)
    base = got["w"]
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap), "a copy, not a view of the file's map"
    got["w"][0, 0] = -1.0
    assert read_safetensors(path)[1]["w"][0, 0] == 0.0  # the file is unchanged
    save_safetensors(path, {"w": np.zeros((64, 64), np.float32), "b": np.zeros(3, np.float16)})
    assert got["w"][0, 0] == -1.0 and np.array_equal(got["w"].reshape(-1)[1:], w.reshape(-1)[1:])
    assert np.array_equal(got["b"], np.ones(3, np.float16))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_a_dropped_tensor_gives_its_pages_back(tmp_path):
    """A weight read, converted and dropped (the device keeps fp16) does not stay resident:
    the pages wholly inside its bytes are returned when its array goes."""
    import gc

    def file_rss_mib() -> float:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssFile"))
        return int(line.split()[1]) / 1024

    path = tmp_path / "big.safetensors"
    save_safetensors(path, {"w": np.ones((64, 1 << 18), np.float32), "keep": np.ones(8, np.float32)})  # 64 MiB
    _, got = read_safetensors(path)
    assert float(got["w"].sum()) == 64 * (1 << 18)  # every page touched: resident now
    touched = file_rss_mib()
    del got["w"]
    gc.collect()
    assert touched - file_rss_mib() > 48, "the dropped tensor's pages stayed resident"
    assert np.array_equal(got["keep"], np.ones(8, np.float32))  # the others still read the file
