"""Kernel folders (docs/architecture.md): save/load round trips, foreign folders, and what a broken one raises."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from anelm.compiler.artifact import Artifact, IOSpec, Signature, signature_from_function
from anelm.chip.profile import STRICT
from anelm.errors import AnelmError, BlobError, CompileError, MILSyntaxError
from anelm.mil.blob import encode_tensor
from anelm.mil.parser import parse

SHARED = Path(__file__).resolve().parents[2].parent / "shared"

MIL = """program(1.3)
{
    func main<ios18>(tensor<fp16, [1, 8, 1, 16]> x, tensor<fp32, [1, 8, 1, 4096]> big) {
        tensor<fp16, [8, 8, 1, 1]> W = const()[name = string("W"), val = tensor<fp16, [8, 8, 1, 1]>(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(64)))];
        tensor<fp16, [1, 1, 1, 16]> m = const()[name = string("m"), val = tensor<fp16, [1, 1, 1, 16]>(BLOBFILE(path = string("@model_path/masks/m.bin"), offset = uint64(64)))];
        tensor<fp16, [1, 8, 1, 16]> y = add(x = x, y = m)[name = string("y")];
    } -> (y, big);
}
"""
W = np.arange(64, dtype=np.float16).reshape(8, 8, 1, 1)
M = np.full((1, 1, 1, 16), -1.0, np.float16)


def make_artifact(meta=None):
    weights = {"@model_path/weights/w.bin": encode_tensor(W), "@model_path/masks/m.bin": encode_tensor(M)}
    return Artifact(MIL, weights, signature_from_function(parse(MIL).main, STRICT), meta or {})


# ----------------------------------------------------------------------------- signature


def test_strict_surfaces_are_uniform_per_direction_and_at_least_48k():
    sig = make_artifact().signature
    # x: 8*16*2 = 256 B; big: 8*4096*4 = 131072 B; inputs share the largest
    assert sig.inputs == [IOSpec("x", "fp16", (1, 8, 1, 16), 131072), IOSpec("big", "fp32", (1, 8, 1, 4096), 131072)]
    # outputs judged apart from inputs: y is 256 B, big 131072 B
    assert [s.surface_bytes for s in sig.outputs] == [131072, 131072] and sig.outputs[0].nbytes == 256


def test_non_uniform_profile_sizes_each_surface_alone():
    profile = STRICT.replace(uniform_input_sizes=False, uniform_output_sizes=False, min_surface_bytes=1024)
    sig = signature_from_function(parse(MIL).main, profile)
    assert [s.surface_bytes for s in sig.inputs] == [1024, 131072]
    assert [s.surface_bytes for s in sig.outputs] == [1024, 131072]


def test_signature_json_round_trip_and_bad_json():
    sig = make_artifact().signature
    assert Signature.from_json(sig.to_json()) == sig
    assert json.loads(sig.to_json())["inputs"][0] == {"name": "x", "dtype": "fp16", "shape": [1, 8, 1, 16],
                                                      "surface_bytes": 131072}
    with pytest.raises(AnelmError, match="not valid JSON"):
        Signature.from_json("{")
    with pytest.raises(AnelmError, match="bad surface entry"):
        Signature.from_json('{"inputs": [{"name": "x"}], "outputs": []}')


def test_returned_name_that_nothing_defines():
    fn = parse(MIL.replace("-> (y, big)", "-> (y, ghost)")).main
    with pytest.raises(CompileError, match="node 'ghost': returned name is not defined"):
        signature_from_function(fn)


# ----------------------------------------------------------------------------- save / load


def test_save_writes_the_kernel_folder_byte_for_byte(tmp_path):
    art = make_artifact(meta={"kernel": "demo"})
    art.save(tmp_path / "k")
    files = sorted(str(p.relative_to(tmp_path / "k")) for p in (tmp_path / "k").rglob("*") if p.is_file())
    assert files == ["masks/m.bin", "meta.json", "model.mil", "signature.json", "weights/w.bin"]
    assert (tmp_path / "k" / "model.mil").read_bytes() == MIL.encode()
    w = (tmp_path / "k" / "weights" / "w.bin").read_bytes()
    assert struct.unpack_from("<IIIIQQ", w, 0)[:2] == (1, 2) and w[128:] == W.tobytes()
    assert Signature.from_json((tmp_path / "k" / "signature.json").read_text()) == art.signature


def test_load_round_trip(tmp_path):
    art = make_artifact(meta={"kernel": "demo", "step": 3})
    back = Artifact.load(art.save(tmp_path / "k"))
    assert back == art and back.key() == art.key()
    assert back.program() is back.program()  # parsed once
    assert back.program().main.outputs == ["y", "big"]


def test_key_follows_content_only():
    a, b = make_artifact(), make_artifact(meta={"other": 1})
    b.weights = dict(reversed(list(b.weights.items())))
    assert a.key() == b.key()  # meta and dict order do not matter
    flipped = bytearray(a.weights["@model_path/weights/w.bin"])
    flipped[-1] ^= 1
    c = make_artifact()
    c.weights["@model_path/weights/w.bin"] = bytes(flipped)
    assert c.key() != a.key()
    assert Artifact(MIL + " ", a.weights, a.signature).key() != a.key()


def test_folder_written_by_someone_else_without_signature():
    root = SHARED / "data" / "mil-conformance"
    if not root.exists():
        pytest.skip("../shared absent: external fixtures are not part of a user's clone")
    index = {c["case"]: c for c in json.loads((root / "index.json").read_text())}
    for case in index:
        art = Artifact.load(root / case)
        assert sorted(s.name for s in art.signature.inputs) == index[case]["inputs"]
        assert sorted(s.name for s in art.signature.outputs) == index[case]["outputs"]
        for spec in art.signature.inputs + art.signature.outputs:
            assert spec.surface_bytes >= max(49152, spec.nbytes)
    art = Artifact.load(root / "swiglu_three_outputs")
    assert sorted(art.weights) == ["@model_path/weights/w1.bin", "@model_path/weights/w3.bin"]
    assert art.weights["@model_path/weights/w1.bin"] == (root / "swiglu_three_outputs/weights/w1.bin").read_bytes()


# ----------------------------------------------------------------------------- broken folders


def test_missing_blob_names_the_path(tmp_path):
    make_artifact().save(tmp_path / "k")
    (tmp_path / "k" / "masks" / "m.bin").unlink()
    with pytest.raises(BlobError, match="@model_path/masks/m.bin"):
        Artifact.load(tmp_path / "k")


def test_blob_that_does_not_match_the_mil(tmp_path):
    make_artifact().save(tmp_path / "k")
    (tmp_path / "k" / "weights" / "w.bin").write_bytes(encode_tensor(np.zeros((4, 8, 1, 1), np.float16)))
    with pytest.raises(BlobError, match=r"@model_path/weights/w.bin: size mismatch"):
        Artifact.load(tmp_path / "k")


def test_malformed_mil_gives_line_and_column(tmp_path):
    make_artifact().save(tmp_path / "k")
    (tmp_path / "k" / "model.mil").write_text(MIL.replace("add(x = x, y = m)", "add(x = x y = m)"))
    with pytest.raises(MILSyntaxError) as e:
        Artifact.load(tmp_path / "k")
    assert (e.value.line, e.value.column) == (6, 51) and "model.mil:6:51" in str(e.value)


def test_non_utf8_and_missing_model(tmp_path):
    make_artifact().save(tmp_path / "k")
    (tmp_path / "k" / "model.mil").write_bytes(b"program(1.3)\n\xff\xfe")
    with pytest.raises(AnelmError, match="byte 13 is not UTF-8") as e:
        Artifact.load(tmp_path / "k")
    assert not isinstance(e.value, MILSyntaxError)
    with pytest.raises(AnelmError, match="no model.mil"):
        Artifact.load(tmp_path / "empty")


def test_signature_json_that_contradicts_the_mil(tmp_path):
    art = make_artifact()
    art.signature = Signature([IOSpec("x", "fp32", (1, 8, 1, 16), 49152)], art.signature.outputs)
    art.save(tmp_path / "k")
    with pytest.raises(AnelmError, match="signature.json: inputs .* do not match the MIL"):
        Artifact.load(tmp_path / "k")


def test_save_refuses_weights_the_mil_cannot_use(tmp_path):
    art = make_artifact()
    del art.weights["@model_path/masks/m.bin"]
    with pytest.raises(BlobError, match="references @model_path/masks/m.bin"):
        art.save(tmp_path / "k")
    escaping = MIL.replace("@model_path/masks/m.bin", "@model_path/../m.bin")
    bad = Artifact(escaping, {"@model_path/weights/w.bin": encode_tensor(W), "@model_path/../m.bin": encode_tensor(M)},
                   make_artifact().signature)
    with pytest.raises(BlobError, match="stay inside the kernel folder"):
        bad.save(tmp_path / "k2")
    assert not (tmp_path / "m.bin").exists()


def test_load_copied_conformance_folder_with_stray_files(tmp_path):
    src = SHARED / "data" / "mil-conformance" / "causal_attention_decomposed"
    if not src.exists():
        pytest.skip("../shared absent: external fixtures are not part of a user's clone")
    shutil.copytree(src, tmp_path / "k")
    (tmp_path / "k" / "weights" / "unused.bin").write_bytes(b"junk")
    art = Artifact.load(tmp_path / "k")
    assert list(art.weights) == ["@model_path/weights/mask.bin"]  # only what the MIL references
    assert [s.name for s in art.signature.inputs] == ["v", "q", "k"]
