"""`anelm quantize --scheme w4` on a tiny Llama (GQA): the folder's 4-bit layout, every reading
command, the kernels' constexpr_blockwise_shift_scale carrying the folder's own 4-bit data, the
device's logits against the CPU reference on the dequantized weights (docs/testing.md), and GGUF Q4_0/Q4_1
blocks taken as they are (quant/w4.py) against the gguf package's own dequantization."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402
from helpers import device_against_cpu  # noqa: E402

from anelm.cli.main import main  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.ir.ops_quant import blockwise_dense  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402
from anelm.mil.blob import unpack_bits  # noqa: E402
from anelm.models.formats.quantized import BlockQuant, quantize_blocks  # noqa: E402

BLOCK = 16  # the tiny model's hidden size is 64: four blocks a row


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("w4") / "llama"
    hf_tiny.make_word_model(d)
    ids = np.random.default_rng(3).integers(3, 96, 200).tolist()
    text = d.parent / "text.txt"
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    q = d.parent / "q4"
    assert main(["quantize", "--model", str(d), "--out", str(q), "--scheme", "w4", "--block-size", str(BLOCK),
                 "--data", str(text), "--calib-tokens", "64", "--eval-tokens", "64", "--device", "emulator"]) == 0
    return d, text, q


def test_folder_layout_and_report(tiny):
    d, _, q = tiny
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    assert qc["scheme"] == "w4" and qc["bits"] == 4 and qc["block_size"] == BLOCK
    t = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert t[name + ".weight"].dtype == np.uint8 and t[name + ".weight"].shape == (64, 64)  # two a byte
    assert t[name + ".weight_scale"].dtype == np.float16 and t[name + ".weight_scale"].shape == (64, 128 // BLOCK)
    assert t[name + ".weight_offset"].shape == (64, 128 // BLOCK)
    emb = "model.embed_tokens.weight"
    assert t[emb].dtype == np.int8 and t[emb[:-6] + "weight_scale"].shape == (96, 64 // BLOCK)
    rep = json.loads((q / "quantization_report.json").read_text())
    assert rep["scheme"] == "w4" and rep["block_size"] == BLOCK and rep["blocks"] == {"requantized": 14}
    assert rep["quantized_bytes"] < 0.6 * rep["source_bytes"]  # the embedding counts as the CPU holds it, fp16
    assert abs(rep["ppl_ratio"] - 1) < 0.05
    speed = rep["predicted_decode_tokens_per_s"]
    assert speed["chip"] == "m4" and speed["quantized"] >= speed["source"] > 0
    assert speed["weight_read_ms"]["quantized"] < 0.5 * speed["weight_read_ms"]["source"]
    # the reader's float32 weights are the blocks dequantized
    config, weights, _ = load_model(q)
    bq = weights.quant.blocks[name]
    assert np.array_equal(weights[name + ".weight"], bq.dense())
    assert np.array_equal(bq.data, unpack_bits(t[name + ".weight"], 4))


def test_kernels_carry_the_folders_4bit_data(tiny):
    _, _, q = tiny
    config, weights, _ = load_model(q)
    stored = load_file(str(q / "model.safetensors"))
    runner = build_runner(config, weights, "emulator", max_context=32)
    runner.prefill([5, 6, 7], runner.new_cache())
    art = next(k for key, k in runner.kernels.items() if key[:2] == ("prefill", 0)).artifact  # whichever bucket
    assert "data = tensor<uint4, [128, 64, 1, 1]>(BLOBFILE" in art.mil_text  # gate/up stay 4-bit
    blob = bytes(next(b for p, b in art.weights.items() if p.endswith("/o_proj_w4_data.bin")))
    packed = stored["model.layers.0.self_attn.o_proj.weight"]
    assert blob[128:] == packed.tobytes()  # BLOBFILE's uint4 packing is the folder's: low nibble first
    # q's rows carry the attention scale in their block scales, k's and v's not
    qkv = bytes(next(b for p, b in art.weights.items() if p.endswith("/qkv_proj_w4_scale.bin")))
    scales = np.frombuffer(qkv[128:], np.float16).reshape(96, -1)
    q_scale = stored["model.layers.0.self_attn.q_proj.weight_scale"]
    k_scale = stored["model.layers.0.self_attn.k_proj.weight_scale"]
    att = 1 / np.sqrt(config.head_dim)
    assert np.allclose(scales[:64].astype(np.float64), q_scale.astype(np.float64) * att, rtol=1e-3)
    assert np.array_equal(scales[64:80], k_scale)


def test_device_logits_against_the_cpu_reference(tiny):
    """The w4 kernels on the emulator against the float32 CPU reference on the same (dequantized)
    weights: the whole-model logits tolerance of docs/testing.md."""
    _, _, q = tiny
    config, weights, _ = load_model(q)
    err = device_against_cpu(config, weights)
    assert err < 3e-2, err


@pytest.mark.parametrize("command", ["perplexity", "generate"])
def test_reading_commands_read_the_folder(tiny, capsys, command):
    _, text, q = tiny
    argv = ["--data", str(text), "--max-tokens", "40"] if command == "perplexity" else \
        ["--prompt", hf_tiny.WORDS[5], "--max-tokens", "4", "--temperature", "0"]
    rc = main([command, "--model", str(q), *argv, "--device", "emulator", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and (out["predictions"] == 39 if command == "perplexity" else len(out["ids"]) >= 1)


def test_a_block_size_that_does_not_divide_is_one_line(tiny, tmp_path, capsys):
    d, text, _ = tiny
    rc = main(["quantize", "--model", str(d), "--out", str(tmp_path / "x"), "--scheme", "w4", "--block-size", "24",
               "--data", str(text), "--calib-tokens", "64", "--eval-tokens", "64", "--device", "emulator"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("anelm: error: --block-size 24") and not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- GGUF blocks

def _gguf_rows(kind: str, w: np.ndarray):
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T

    return np.asarray(gq.quantize(w, getattr(T, kind))), lambda raw: gq.dequantize(raw, getattr(T, kind))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_are_taken_as_they_are(kind):
    """Q4_0: the device's dense weight is exactly the fp16 rounding of the gguf package's value;
    Q4_1: within the offset's rounding (quant/w4.py: about 2 fp16 steps of the block's largest |w|)."""
    from anelm.quant.w4 import _blocks, _gguf_value

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((24, 96)) * 0.05 + rng.uniform(-0.02, 0.02, (24, 1))).astype(np.float32)
    w[3, :32] = 0.0  # a constant block: d = 0 for Q4_1
    raw, deq = _gguf_rows(kind, w)
    ref = np.asarray(deq(raw), np.float32)
    bq = _blocks(raw, kind)
    assert bq is not None and np.array_equal(_gguf_value(bq, kind, raw, np.arange(24)[:, None]), ref)
    sh = lambda a: np.asarray(a).reshape(24, -1, 1, 1)  # noqa: E731
    dense = blockwise_dense(sh(bq.data).reshape(24, 96, 1, 1), sh(bq.scale), sh(bq.offset))[:, :, 0, 0]
    if kind == "Q4_0":
        assert bq.offset.dtype == np.uint8 and np.array_equal(dense, ref.astype(np.float16))
    else:
        step = np.repeat(np.abs(ref).reshape(24, 3, 32).max(axis=2), 32, axis=1) * 2.0 ** -10  # an fp16 step
        assert np.all(np.abs(dense.astype(np.float64) - ref) <= 2 * step + 1e-12)
        assert np.array_equal(dense[3, :32], ref[3, :32].astype(np.float16))  # the d = 0 block: exact


def test_requantizing_a_q4_1_grid_gives_it_back():
    """Our min..max quantizer on weights that already lie on a Q4_1 grid (levels 0 and 15 used)
    lands on that grid: requantizing a Q4_1 model at its block size loses nothing but the
    offset's fp16 rounding."""
    rng = np.random.default_rng(6)
    q = rng.integers(0, 16, (8, 64)).astype(np.float32)
    q[:, ::32], q[:, 1::32] = 0, 15
    d = np.repeat((rng.uniform(1, 2, (8, 2)) * 2.0 ** -8).astype(np.float16).astype(np.float32), 32, axis=1)
    m = np.repeat(-(rng.uniform(0, 8, (8, 2)) * 2.0 ** -8).astype(np.float16).astype(np.float32), 32, axis=1)
    w = d * q + m
    bq = quantize_blocks(w, 32)
    assert np.array_equal(bq.data, q.astype(np.uint8))
    assert isinstance(bq, BlockQuant) and np.abs(bq.dense() - w).max() <= np.abs(w).max() * 2.0 ** -9


def test_the_cost_annotation_counts_the_4bit_bytes(tiny):
    """A decode program's weight bytes (what an evaluation reads) count the 4-bit data at half a
    byte a weight, so W4's are under half the fp16 program's; the packed data const is its blob's
    payload size."""
    from anelm.chip.profile import STRICT
    from anelm.compiler.pipeline import compile_graph
    from anelm.kernels.decode import decode_layer
    from anelm.kernels.int8 import plan_layer
    from anelm.kernels.layers import layer_params, layer_shape
    from anelm.models.names import layer_weights

    config, weights, _ = load_model(tiny[2])
    s = layer_shape(config)
    raw = layer_weights(config, weights, 0)
    cost = {}
    for kind, p in (("fp16", layer_params(s, raw)), ("w4", plan_layer(weights.quant, 0, s, raw))):
        graph = decode_layer(s, p, 32, s.family.rotary, columns=16)
        art = compile_graph(graph, STRICT)
        cost[kind] = art.meta["cost"]["weight_bytes"]
        if kind == "w4":
            data = next(n for n in graph.nodes if n.is_const and n.name == "o_proj_w4_data")
            assert data.out.type.dtype == "uint4" and data.out.type.nbytes == 64 * 64 // 2
    linears = sum(int(np.prod(b.shape)) for b in weights.quant.layer_blocks(0).values())
    assert cost["fp16"] - cost["w4"] >= linears * (2 - 0.5 - 4 / BLOCK) * 0.9  # fp16 -> 4 bits + scale, offset


def test_a_w4_folder_larger_than_its_gguf_says_why(capsys):
    """SmolLM2's Q4_1 GGUF (98.4 MB) -> its W4 folder (100.2 MB, as measured): the same blocks,
    plus a tokenizer.json that the GGUF keeps packed in its header."""
    from anelm.quant.command import print_summary

    report = {"scheme": "w4", "source_ppl": 27.4247, "quantized_ppl": 27.4103, "ppl_ratio": 0.9995, "eval_tokens": 128,
              "source_bytes": 269030016, "quantized_bytes": 123048576, "max_activation": None,
              "file_bytes": 100178026, "source_file_bytes": 98362432,
              "file_breakdown": {"quantized weights": 81395712, "scales and offsets": 15040512,
                                 "float32 tensors": 140544, "other files": 3524338},
              "predicted_decode_tokens_per_s": {"chip": "m4", "source": 35.3, "quantized": 35.3,
                                                "weight_read_ms": {"source": 1.85, "quantized": 0.58}}}
    print_summary(report)
    err = capsys.readouterr().err
    assert "predicted decode on m4: 35 -> 35 tokens/s (weight reads 1.85 -> 0.58 ms a token)" in err
    assert "its tensors take 92.1 MiB" in err and "tokenizer" in err and "(3.4 MiB)" in err


@pytest.mark.parametrize("kind", ["gpt2", "qwen3-untied", "gemma3", "qwen2"])
def test_other_families_against_the_cpu_reference(kind, tmp_path):
    """GPT-2 (fused c_attn, LayerNorm's shift folded into the bias, Conv1D layout), Qwen3 (q/k
    norms carrying the attention scale, an untied head stored as int8 blocks), Gemma 3 (gains
    1 + w, post-norms), Qwen2 (q/k/v biases): the W4 kernels on the emulator against the float32
    CPU reference on the folder's weights, docs/testing.md's 3e-2."""
    from anelm.quant.command import build_folder

    hf_tiny.make_word_model(tmp_path / "m", kind=kind)
    config, weights, tok = load_model(tmp_path / "m")
    folder, plan, _ = build_folder(tmp_path / "q", config, weights, tok, "w4", [], 32, False, block_size=BLOCK)
    config, weights, _ = load_model(folder)
    err = device_against_cpu(config, weights)
    assert err < 3e-2, err


def test_4bit_tables_read_back_as_their_blocks(tiny):
    """quant/w4.py's w4_tables: a table stored as 4-bit blocks (Gemma 3's tied embedding) reads
    back as its blocks, the one weight the row lookup and the tied head both read."""
    from anelm.models.formats.quantized import linear_names, pack_w4, unpack_w4
    from anelm.quant.w4 import fit_blocks

    config, weights, _ = load_model(tiny[0])
    emb = "model.embed_tokens.weight"
    bq = fit_blocks(weights[emb], 32, np.linspace(0.5, 2, 64))
    linears = {n: quantize_blocks(weights[n + ".weight"], BLOCK) for n in linear_names(config)}
    raw = pack_w4(config, weights, linears, BLOCK, {emb: bq})
    assert raw[emb].dtype == np.uint8 and raw[emb + "_scale"].shape == (96, 2) and raw[emb + "_offset"].dtype == np.float16
    out, _ = unpack_w4(raw, config, "test")
    assert np.array_equal(out[emb], bq.dense()) and not any(k.startswith(emb + "_") for k in out)
