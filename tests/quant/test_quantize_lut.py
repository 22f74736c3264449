"""`anelm quantize --scheme lut4|lut6` on a tiny Llama (GQA): the folder's palettized layout, the
kernels' constexpr_lut_to_dense carrying the folder's own indices and its tables (q's with the
attention scale folded in), the device's logits against the CPU reference on the dequantized
weights (docs/testing.md), every reading command, bad flags as one line, and the k-means itself."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402
from helpers import device_against_cpu  # noqa: E402

from anelm.cli.main import main  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.mil.blob import unpack_bits  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402
from anelm.models.formats.quantized import LutQuant  # noqa: E402
from anelm.quant.lut import palettize  # noqa: E402

GROUP = 16  # rows a table (the tiny model's q has 64 rows, k and v 16 each)


def _quantize(d, text, out, scheme, *extra):
    return main(["quantize", "--model", str(d), "--out", str(out), "--scheme", scheme, *extra, "--data", str(text),
                 "--calib-tokens", "64", "--eval-tokens", "64", "--device", "emulator"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lut") / "llama"
    hf_tiny.make_word_model(d)
    ids = np.random.default_rng(3).integers(3, 96, 200).tolist()
    text = d.parent / "text.txt"
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    q4, q6 = d.parent / "lut4", d.parent / "lut6"
    assert _quantize(d, text, q4, "lut4", "--group-size", str(GROUP), "--block-size", "32") == 0
    assert _quantize(d, text, q6, "lut6") == 0
    return d, text, q4, q6


@pytest.mark.parametrize("bits", [4, 6])
def test_folder_layout_and_report(tiny, bits):
    q = tiny[2] if bits == 4 else tiny[3]
    group, block = (GROUP, 32) if bits == 4 else (16, 128)  # lut6's defaults: 16 rows by a whole row
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    assert qc["scheme"] == f"lut{bits}" and qc["bits"] == bits and qc["group_size"] == group
    t = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert t[name + ".weight"].dtype == np.uint8 and t[name + ".weight"].shape == (64, 128 * bits // 8)
    assert t[name + ".weight_lut"].dtype == np.float16 and t[name + ".weight_lut"].shape == (64 // group, 128 // block,
                                                                                             2 ** bits)
    assert t["model.embed_tokens.weight"].dtype == np.int8  # as W4 stores it
    rep = json.loads((q / "quantization_report.json").read_text())
    assert rep["scheme"] == f"lut{bits}" and rep["group_size"] == group
    assert rep["quantized_bytes"] < 0.7 * rep["source_bytes"]
    assert abs(rep["ppl_ratio"] - 1) < 0.05, rep["ppl_ratio"]
    speed = rep["predicted_decode_tokens_per_s"]
    assert speed["quantized"] >= speed["source"] > 0
    assert speed["weight_read_ms"]["quantized"] < 0.7 * speed["weight_read_ms"]["source"]
    config, weights, _ = load_model(q)  # the reader's float32 weights are the tables' entries
    lq = weights.quant.blocks[name]
    assert isinstance(lq, LutQuant) and np.array_equal(lq.indices, unpack_bits(t[name + ".weight"], bits))
    assert np.array_equal(weights[name + ".weight"], lq.dense())


def test_kernels_carry_the_folders_indices_and_tables(tiny):
    q = tiny[2]
    config, weights, _ = load_model(q)
    stored = load_file(str(q / "model.safetensors"))
    runner = build_runner(config, weights, "emulator", max_context=32)
    runner.prefill([5, 6, 7], runner.new_cache())
    art = next(k for key, k in runner.kernels.items() if key[:2] == ("prefill", 0)).artifact
    assert "indices = tensor<uint4, [128, 64, 1, 1]>(BLOBFILE" in art.mil_text  # gate/up stay 4-bit
    assert "_rows" not in "".join(art.weights)  # every fold went into the tables
    blob = bytes(next(b for p, b in art.weights.items() if p.endswith("/o_proj_lut_indices.bin")))
    assert blob[128:] == stored["model.layers.0.self_attn.o_proj.weight"].tobytes()
    luts = bytes(next(b for p, b in art.weights.items() if p.endswith("/qkv_proj_lut_lut.bin")))
    tables = np.frombuffer(luts[128:], np.float16).reshape(-1, 2, 16)  # q's 4 groups, k's 1, v's 1
    att = 1 / np.sqrt(config.head_dim)  # each table entry times it, rounded to fp16 once
    q_lut = stored["model.layers.0.self_attn.q_proj.weight_lut"].astype(np.float64)
    assert np.allclose(tables[:4].astype(np.float64), q_lut * att, rtol=2.0 ** -11, atol=2.0 ** -24)
    assert np.array_equal(tables[4:5], stored["model.layers.0.self_attn.k_proj.weight_lut"])


@pytest.mark.parametrize("bits", [4, 6])
def test_device_logits_against_the_cpu_reference(tiny, bits):
    config, weights, _ = load_model(tiny[2] if bits == 4 else tiny[3])
    err = device_against_cpu(config, weights)
    assert err < 3e-2, err


@pytest.mark.parametrize("command", ["perplexity", "generate"])
def test_reading_commands_read_the_folder(tiny, capsys, command):
    _, text, q, _ = tiny
    argv = ["--data", str(text), "--max-tokens", "40"] if command == "perplexity" else \
        ["--prompt", hf_tiny.WORDS[5], "--max-tokens", "4", "--temperature", "0"]
    rc = main([command, "--model", str(q), *argv, "--device", "emulator", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and (out["predictions"] == 39 if command == "perplexity" else len(out["ids"]) >= 1)


@pytest.mark.parametrize("extra, says", [(["--scheme", "lut4", "--group-size", "24"], "--group-size 24"),
                                         (["--scheme", "w4", "--group-size", "2"], "quantize: --group-size")])
def test_bad_flags_are_one_line(tiny, tmp_path, capsys, extra, says):
    d, text, _, _ = tiny
    rc = main(["quantize", "--model", str(d), "--out", str(tmp_path / "x"), *extra, "--data", str(text),
               "--calib-tokens", "64", "--eval-tokens", "64", "--device", "emulator"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and err[-1].startswith(f"anelm: error: {says}") and not (tmp_path / "x").exists()


def test_kmeans_finds_a_grid_and_takes_the_nearest_entry():
    """Weights on 16 levels per tile come back exactly (the tables start evenly spaced min..max, as
    a Q4_1 block's levels are); random weights take their nearest table entry."""
    rng = np.random.default_rng(1)
    levels = np.sort(rng.standard_normal((4, 16)), axis=1).astype(np.float16).astype(np.float32)
    levels = levels[:, :1] + (levels[:, -1:] - levels[:, :1]) * np.arange(16) / 15  # an even grid per tile
    levels = levels.astype(np.float16).astype(np.float32)
    idx = rng.integers(0, 16, (8, 64))
    idx[:, 0], idx[:, 1] = 0, 15
    w = np.take_along_axis(np.repeat(levels, 2, 0), idx, 1)
    lq = palettize(w, 4, 2, 64)
    assert np.array_equal(lq.dense(), w)
    w = rng.standard_normal((32, 48)).astype(np.float32)
    lq = palettize(w, 4, 8, 16, importance=rng.uniform(0.1, 2, 48))
    full = np.repeat(np.repeat(lq.lut, 8, 0), 16, 1).astype(np.float64)  # [32, 48, 16]
    best = np.abs(w[:, :, None] - full).min(axis=2)
    assert np.array_equal(np.abs(w - lq.dense().astype(np.float64)), best)


def test_row_factors_a_table_cannot_take_scale_the_output_rows():
    """A fold whose factor differs between the rows of one table (none of ours does) is left to a
    multiply of the conv's output rows; a factor shared by a group's rows goes into its table.
    The kernel's result equals the folded dense weight's product either way."""
    from anelm.chip.profile import STRICT
    from anelm.compiler.pipeline import compile_graph
    from anelm.device.emulator import Emulator
    from anelm.ir.builder import GraphBuilder
    from anelm.kernels.qlinear import QLinear, quant_linear
    from anelm.runtime.kernel import Kernel

    rng = np.random.default_rng(4)
    lq = palettize(rng.standard_normal((32, 64)).astype(np.float32) * 0.1, 4, 8, 64)
    factor = np.repeat([0.5, 2.0, 1.0, 0.25], 8)
    factor[24:28] = 4.0  # the last table's rows disagree
    scaled = lq.rows_scaled(factor)
    assert np.array_equal(scaled.lut[:3], (lq.lut[:3] * np.array([0.5, 2.0, 1.0])[:, None, None]).astype(np.float16))
    assert np.array_equal(scaled.lut[3], lq.lut[3]) and scaled.out_scale is not None
    assert np.array_equal(scaled.out_scale, np.r_[np.ones(24), factor[24:]].astype(np.float32))
    b = GraphBuilder("lut_rows")
    x = b.input("x", [1, 64, 1, 16])
    b.output("y", quant_linear(b, x, QLinear(scaled, scaled.out_scale), name="y"))
    art = compile_graph(b.build(), STRICT)
    xs = rng.uniform(-1, 1, (1, 64, 1, 16)).astype(np.float16)
    got = np.asarray(Kernel(art, Emulator(STRICT))(x=xs)["y"], np.float64)[0, :, 0, :]
    ref = (lq.dense() * factor[:, None]) @ xs[0, :, 0, :].astype(np.float64)
    assert np.abs(got - ref).max() <= 3e-3 * np.abs(ref).max()
    # the cost pass counts the stored bytes: packed indices, fp16 tables, the row factors
    from anelm.chip.cost import KernelCost

    assert KernelCost.of(art).weight_bytes == 32 * 64 // 2 + 2 * scaled.lut.size + 2 * 32


def test_a_lut4_folder_larger_than_its_gguf_says_why(capsys):
    """SmolLM2's Q4_1 GGUF (98.4 MB) -> its lut4 folder (104.6 MB, as measured): 4-bit indices and
    a table per 192 weights take more than Q4_1's blocks; the note says so, not W4's reason."""
    from anelm.quant.command import print_summary

    report = {"scheme": "lut4", "source_ppl": 27.425, "quantized_ppl": 28.745, "ppl_ratio": 1.048, "eval_tokens": 128,
              "source_bytes": 269030016, "quantized_bytes": 127472256, "max_activation": None,
              "file_bytes": 104600000, "source_file_bytes": 98362432,
              "file_breakdown": {"quantized weights": 81395712, "scales and offsets": 19500000,
                                 "float32 tensors": 140544, "other files": 3524338}}
    print_summary(report)
    err = capsys.readouterr().err
    assert "lut4: perplexity 27.4250 -> 28.7450" in err and "4-bit indices with fp16 tables" in err
