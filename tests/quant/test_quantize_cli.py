"""`anelm quantize` and the quantized folder (docs/quantization.md) on a tiny Llama (GQA): the folder's
layout, every reading command, the refusals, and the int8 the kernels carry."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402

from anelm.cli.main import main  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.mil.blob import blob_chunks  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402

REPORT_KEYS = {"scheme", "source_ppl", "quantized_ppl", "eval_tokens", "source_bytes", "quantized_bytes",
               "max_activation"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant") / "llama"
    hf_tiny.make_word_model(d)
    ids = np.random.default_rng(3).integers(3, 96, 200).tolist()
    text = d.parent / "text.txt"
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    return d, text


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def folders(tiny, tmp_path_factory):
    d, text = tiny
    out = {}
    for scheme in ("w8", "w8a8"):
        q = tmp_path_factory.mktemp("q") / scheme
        assert main(["quantize", "--model", str(d), "--out", str(q), "--scheme", scheme, "--data", str(text),
                     "--calib-tokens", "64", "--eval-tokens", "64", "--device", "emulator"]) == 0
        out[scheme] = q
    return out


@pytest.mark.parametrize("scheme", ["w8", "w8a8"])
def test_folder_layout_and_report(folders, tiny, scheme):
    q = folders[scheme]
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "anelm" and cfg["quantization_config"]["scheme"] == scheme
    assert (q / "tokenizer.json").is_file()
    t = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    assert t[name + ".weight"].dtype == np.int8 and t[name + ".weight_scale"].dtype == np.float32
    assert (name + ".input_scale" in t) == (scheme == "w8a8")
    rep = json.loads((q / "quantization_report.json").read_text())
    assert REPORT_KEYS <= set(rep) and rep["scheme"] == scheme and rep["eval_tokens"] == 64
    assert rep["quantized_bytes"] < 0.6 * rep["source_bytes"]
    # a random tiny model has small, even activations: int8 barely moves its perplexity
    assert abs(rep["quantized_ppl"] / rep["source_ppl"] - 1) < 0.05


def test_kernels_carry_the_folders_int8(folders):
    config, weights, _ = load_model(folders["w8a8"])
    runner = build_runner(config, weights, "emulator", max_context=32)
    runner.prefill([5, 6, 7], runner.new_cache())
    kernel = runner.kernels[("prefill", 0, runner.plan.bucket(3))]
    art = kernel.artifact
    assert "constexpr_affine_dequantize" in art.mil_text and "quantize(" in art.mil_text
    chunks = {p: blob_chunks(b) for p, b in art.weights.items()}
    assert any(c.dtype == "int8" for cs in chunks.values() for c in cs)
    # the o projection's int8 blob is the folder's o_proj int8, byte for byte (models/formats/quantized.py doc)
    stored = load_file(str(folders["w8a8"] / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    blob = next(b for p, b in art.weights.items() if "o_proj_w8_quantized_data" in p)
    assert blob_chunks(blob)[0].dtype == "int8"
    assert bytes(blob[128:128 + stored.size]) == stored.tobytes()


@pytest.mark.parametrize("scheme", ["w8", "w8a8"])
def test_every_reading_command_reads_the_folder(folders, tiny, capsys, scheme):
    q, (_, text) = folders[scheme], tiny
    rc, out, _ = cli(capsys, "perplexity", "--model", str(q), "--data", str(text), "--max-tokens", "40",
                     "--device", "emulator", "--json")
    assert rc == 0 and json.loads(out)["predictions"] == 39
    rc, out, _ = cli(capsys, "generate", "--model", str(q), "--prompt", hf_tiny.WORDS[5], "--max-tokens", "4",
                     "--temperature", "0", "--device", "emulator", "--json")
    assert rc == 0 and len(json.loads(out)["ids"]) >= 1


@pytest.mark.parametrize("argv", [["quantize", "--model", "{q}", "--out", "{tmp}/again"],
                                  ["export", "{q}", "--out", "{tmp}/hf"],
                                  ["train", "--init-from", "{q}", "--steps", "1", "--out", "{tmp}/run"]])
def test_writing_commands_refuse_the_folder(folders, tmp_path, capsys, argv):
    argv = [a.format(q=folders["w8"], tmp=tmp_path) for a in argv]
    rc, _, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 1 and lines[-1].startswith("anelm: error: ") and "quantized folder" in lines[-1]


def test_w8a8_needs_data(tiny, tmp_path, capsys):
    rc, _, err = cli(capsys, "quantize", "--model", str(tiny[0]), "--out", str(tmp_path / "x"), "--scheme", "w8a8")
    assert rc == 2 and err.startswith("anelm: error: ") and "--data" in err


def test_an_unwritable_out_fails_before_any_work(tiny, monkeypatch, capsys):
    """/proc takes no new folders, as a read-only file system would not: refused before the
    model loads (quantizing takes minutes), and the folders quantized before are readable
    by others: 0755 (the umask's), not mkdtemp's private 0700."""
    import anelm.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    rc, _, err = cli(capsys, "quantize", "--model", str(tiny[0]), "--out", "/proc/self/anelm-q", "--data", str(tiny[1]))
    assert rc == 1 and err.startswith("anelm: error: cannot write /proc/self/anelm-q"), err


def test_quantized_folders_take_the_umasks_modes(folders):
    import os
    import stat

    for q in folders.values():
        assert stat.S_IMODE(os.stat(q).st_mode) == 0o777 & ~_umask()
        assert stat.S_IMODE(os.stat(q / "model.safetensors").st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_folder_larger_than_its_source_says_so(capsys):
    from anelm.quant.command import print_summary

    report = {"scheme": "w8", "source_ppl": 10.0, "quantized_ppl": 10.1, "ppl_ratio": 1.01, "eval_tokens": 256,
              "source_bytes": 300 << 20, "quantized_bytes": 150 << 20, "max_activation": 3.0,
              "file_bytes": 214 << 20, "source_file_bytes": 98 << 20}  # SmolLM2's Q4_1 GGUF, as the issue met it
    print_summary(report)
    err = capsys.readouterr().err
    assert "214 MiB on disk, more than its source's 98 MiB" in err
    print_summary({**report, "file_bytes": 90 << 20})
    assert "on disk" not in capsys.readouterr().err
