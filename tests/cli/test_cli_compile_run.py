"""`anelm compile`, `anelm run-mil` and `anelm demo` end to end, and their one-line errors.

run-mil's numbers are checked against a float64 numpy reference of the program written here.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.mil.blob import encode_tensor

MIL = """program(1.3)
[buildInfo = dict<string, string>({{"coremlc-component-MIL", "3510.2.1"}})]
{
    func main<ios18>(tensor<fp16, [1, 8, 1, 16]> x, tensor<fp16, [1, 8, 1, 16]> b) {
        tensor<fp16, [8, 8, 1, 1]> W = const()[name = string("W"), val = tensor<fp16, [8, 8, 1, 1]>(BLOBFILE(path = string("@model_path/weights/w.bin"), offset = uint64(64)))];
        string pt = const()[name = string("pt"), val = string("valid")];
        tensor<int32, [2]> st = const()[name = string("st"), val = tensor<int32, [2]>([1, 1])];
        tensor<int32, [4]> pd = const()[name = string("pd"), val = tensor<int32, [4]>([0, 0, 0, 0])];
        tensor<int32, [2]> dl = const()[name = string("dl"), val = tensor<int32, [2]>([1, 1])];
        int32 gr = const()[name = string("gr"), val = int32(1)];
        tensor<fp16, [1, 8, 1, 16]> h = conv(dilations = dl, groups = gr, pad = pd, pad_type = pt, strides = st, weight = W, x = x)[name = string("h")];
        tensor<fp16, [1, 8, 1, 16]> y = add(x = h, y = b)[name = string("y")];
    } -> (y);
}
"""
RNG = np.random.default_rng(0)
W = (RNG.standard_normal((8, 8)) * 0.3).astype(np.float16)


def folder(tmp_path: Path, text: str = MIL, blob: bytes | None = None) -> Path:
    d = tmp_path / "k"
    (d / "weights").mkdir(parents=True)
    (d / "model.mil").write_text(text)
    (d / "weights" / "w.bin").write_bytes(encode_tensor(W.reshape(8, 8, 1, 1)) if blob is None else blob)
    return d


def inputs(tmp_path: Path, **arrays) -> str:
    p = tmp_path / "in.npz"
    np.savez(p, **arrays)
    return str(p)


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *needles):
    """Exit 1 and exactly one error line, the last one (a device notice may come before it)."""
    lines = err.splitlines()
    assert code == 1 and lines[-1].startswith("anelm: error: "), err
    assert sum(line.startswith("anelm: error:") for line in lines) == 1 and "Traceback" not in err
    err = lines[-1]
    for n in needles:
        assert n in err, (n, err)


def test_run_mil_matches_numpy(tmp_path, capsys):
    x = RNG.standard_normal((1, 8, 1, 16)).astype(np.float32)  # fp32 is cast (rounded) to fp16
    b = RNG.standard_normal((1, 8, 1, 16)).astype(np.float16)
    out = tmp_path / "out.npz"
    code, _, err = cli(capsys, "run-mil", str(folder(tmp_path)), "--inputs", inputs(tmp_path, x=x, b=b),
                       f"--out={out}", "--device", "emulator")
    assert code == 0, err
    y = np.load(out)["y"]
    ref = np.einsum("oi,is->os", W.astype(np.float64), x.astype(np.float16).astype(np.float64)[0, :, 0])
    ref = ref + b.astype(np.float64)[0, :, 0]
    assert y.dtype == np.float16 and y.shape == (1, 8, 1, 16)
    assert np.abs(y[0, :, 0] - ref).max() / np.abs(ref).max() <= 1e-2  # conv (docs/testing.md)


def test_run_mil_bad_inputs_are_one_line_errors(tmp_path, capsys):
    d = folder(tmp_path)
    x = np.zeros((1, 8, 1, 16), np.float16)
    out = str(tmp_path / "o.npz")
    code, _, err = cli(capsys, "run-mil", str(d), "--inputs", inputs(tmp_path, x=x), "--out", out)
    one_line_error(code, err, "missing", "b")
    code, _, err = cli(capsys, "run-mil", str(d), "--inputs", inputs(tmp_path, x=x, b=x, c=x), "--out", out)
    one_line_error(code, err, "c")
    code, _, err = cli(capsys, "run-mil", str(d), "--inputs", inputs(tmp_path, x=x[:, :4], b=x), "--out", out)
    one_line_error(code, err, "x", "[1, 8, 1, 16]", "[1, 4, 1, 16]")
    words = np.full((1, 8, 1, 16), "a")
    code, _, err = cli(capsys, "run-mil", str(d), "--inputs", inputs(tmp_path, x=words, b=x), "--out", out)
    one_line_error(code, err, "x", "fp16")
    assert not Path(out).exists()


def test_malformed_mil_reports_line_and_column(tmp_path, capsys):
    bad = MIL.replace("add(x = h, y = b)", "add(x = h, y = )")
    d = folder(tmp_path, bad)
    line = next(i for i, s in enumerate(bad.splitlines(), 1) if "add(x = h, y = )" in s)
    x = np.zeros((1, 8, 1, 16), np.float16)
    code, _, err = cli(capsys, "run-mil", str(d), "--inputs", inputs(tmp_path, x=x, b=x), "--out", str(tmp_path / "o.npz"))
    one_line_error(code, err, f":{line}:")


@pytest.mark.parametrize("what", ["missing", "truncated", "wrong-offset"])
def test_bad_blobs_are_one_line_errors(tmp_path, capsys, what):
    good = encode_tensor(W.reshape(8, 8, 1, 1))
    text, blob = MIL, good
    if what == "truncated":
        blob = good[:100]
    elif what == "wrong-offset":
        text = MIL.replace("offset = uint64(64)", "offset = uint64(128)")
    d = folder(tmp_path, text, blob)
    if what == "missing":
        (d / "weights" / "w.bin").unlink()
    x = np.zeros((1, 8, 1, 16), np.float16)
    code, _, err = cli(capsys, "run-mil", str(d), "--inputs", inputs(tmp_path, x=x, b=x), "--out", str(tmp_path / "o.npz"))
    one_line_error(code, err, "w.bin")


def test_compile_writes_folders_that_run_mil_runs(tmp_path, capsys):
    out = tmp_path / "kern"
    code, _, err = cli(capsys, "compile", "--dim", "64", "--heads", "4", "--kv-heads", "2", "--seq", "16",
                       "--out", str(out))
    assert code == 0, err
    layer = out / "layer00"
    assert (layer / "model.mil").is_file() and (layer / "signature.json").is_file()
    x = RNG.standard_normal((1, 64, 1, 16)).astype(np.float32)
    code, _, err = cli(capsys, "run-mil", str(layer), "--inputs", inputs(tmp_path, x=x), "--out", str(tmp_path / "y.npz"))
    assert code == 0, err
    y = np.load(tmp_path / "y.npz")["y"]
    assert y.shape == (1, 64, 1, 16) and np.isfinite(y).all() and np.abs(y - x).max() > 1e-3
    code, _, err = cli(capsys, "compile", "--kind", "train", "--dim", "64", "--heads", "4", "--seq", "16",
                       "--out", str(tmp_path / "train"))
    assert code == 0 and len([p for p in (tmp_path / "train").iterdir() if p.is_dir()]) == 10


def test_usage_errors_exit_2(capsys):
    code, _, err = cli(capsys, "compile", "--dim", "0")
    assert code == 2 and err.startswith("anelm: error: ") and err.count("\n") == 1
    code, _, err = cli(capsys, "run-mil", "x", "--inputs", "a.npz", "--out", "b.npz", "--bogus")
    assert code == 2 and "--bogus" in err


def test_demo_and_module_entry_point_agree():
    """`python -m anelm` is the console script; the demo checks itself against the CPU."""
    r = subprocess.run([sys.executable, "-m", "anelm", "demo", "--dim", "64", "--heads", "4", "--kv-heads", "2",
                        "--seq", "16", "--device", "emulator"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "device: emulator" in r.stderr and "ok" in r.stderr and r.stdout.startswith("ran on emulator")


def test_abbreviated_options_are_unknown(capsys):
    code, _, err = cli(capsys, "compile", "--dim", "64", "--hid", "128")
    assert code == 2 and "--hid" in err and err.startswith("anelm: error: ")


def test_readme_run_mil_recipe_builds_inputs_from_the_signature(tmp_path, capsys, monkeypatch):
    """The README's run-mil example says where the input names and shapes come from, and its
    recipe for in.npz works on a folder `anelm compile` wrote."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    recipe = next(block.split("\n", 1)[1] for block in readme.split("```sh")[1:]
                  if "signature.json" in block.split("```")[0] and "np.savez" in block)
    recipe = recipe.split("```")[0].strip()
    assert recipe.startswith('python -c "') and recipe.endswith('"')
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, "compile", "--dim", "32", "--heads", "2", "--seq", "16", "--out", "kernels")[0] == 0
    exec(recipe[len('python -c "'):-1], {})  # the one-liner, as python -c runs it
    code, _, err = cli(capsys, "run-mil", "kernels/layer00", "--inputs", "in.npz", "--out", "out.npz")
    assert code == 0, err
    assert np.load("out.npz")["y"].shape == (1, 32, 1, 16)


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


SMALL = ["compile", "--dim", "32", "--heads", "2", "--seq", "16"]


def test_recompiling_replaces_the_folder_whole(tmp_path, capsys):
    out = tmp_path / "kern"
    assert cli(capsys, *SMALL, "--layers", "2", "--out", str(out))[0] == 0
    assert (out / "layer01" / "model.mil").is_file()
    assert json.loads((out / "kernels.json").read_text())["kernels"] == ["layer00", "layer01"]
    code, _, err = cli(capsys, *SMALL, "--arch", "gpt2", "--out", str(out))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["kernels.json", "layer00"]  # no stale layer01
    assert json.loads((out / "kernels.json").read_text())["kernels"] == ["layer00"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kern"]  # no temp folder left beside it


def test_a_folder_compile_did_not_write_is_refused_untouched(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    before = tree(out)
    code, _, err = cli(capsys, *SMALL, "--out", str(out))
    one_line_error(code, err, str(out), "kernels.json", "not empty")
    assert tree(out) == before and sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert cli(capsys, *SMALL, "--out", str(tmp_path / "empty"))[0] == 0


def test_an_interrupted_build_leaves_the_old_folder_intact(tmp_path, capsys, monkeypatch):
    from anelm.compiler import artifact

    out = tmp_path / "kern"
    assert cli(capsys, *SMALL, "--layers", "2", "--out", str(out))[0] == 0
    before = tree(out)
    save, saved = artifact.Artifact.save, []

    def save_then_interrupt(self, directory):
        if saved:
            raise KeyboardInterrupt  # Ctrl-C after the first kernel folder of the new build
        saved.append(directory)
        return save(self, directory)

    monkeypatch.setattr(artifact.Artifact, "save", save_then_interrupt)
    code, _, err = cli(capsys, *SMALL, "--layers", "3", "--seed", "5", "--out", str(out))
    assert code == 130 and saved and "interrupted" in err
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kern"]
