"""The one safetensors reader and writer, against the reference implementation's."""

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from anelm.models.safetensors_io import SafetensorsError, read_safetensors, save_safetensors


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
