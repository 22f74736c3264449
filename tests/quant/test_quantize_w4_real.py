"""W4 on the real model (docs/quantization.md's bounds): SmolLM2-135M's Q4_1 GGUF
converted block for block (`quantize --scheme w4`, block size 32: the file's own 210 Q4_1
blocks, quant/w4.py) and run on the emulator under `strict`, against the GGUF dequantized run
on the same device and profile, on held-out prose: test_quantize_real.py's (the Apache
license, 256 tokens past the start, the next 128 scored; the emulator's figures are the same
for its longer windows, within noise).

Logits tolerance: max|w4 − GGUF| / max|GGUF| ≤ 1e-2 (docs/testing.md's matmul class) with every argmax
shared. Why that is "within fp16 rounding": the two runs differ only in fp16 rounding — the
Q4_1 offset −m/d rounded to fp16 (a weight moves by at most ~2 fp16 steps of its block's
largest |w|), and the norm gains applied to the inputs rather than folded into fp16 weight
columns — and measured that is no more than the fp16 pipeline's own distance from float32:
w4 vs GGUF on the device 4.9e-3, the GGUF on the device vs the float32 CPU reference 4.9e-3,
w4 vs that reference 3.7e-3, every argmax shared in all three.
"""

import numpy as np
import pytest

from anelm.generate.perplexity import token_nll
from anelm.generate.pipeline import build_runner
from anelm.models.loading import load_model
from anelm.quant.command import build_folder, device_bytes, split_text

SEQ = 128


@pytest.fixture(scope="module")
def runs(smollm, smollm_gguf, tmp_path_factory):
    config, weights, tok = smollm
    text = (smollm_gguf.parents[1] / "text" / "apache-2.0.txt").read_text(encoding="utf-8")
    calib, held = split_text(tok, text, 256, SEQ)
    source = build_runner(config, weights, "emulator", SEQ)
    ref = source.prefill(held, source.new_cache())
    folder, plan, _ = build_folder(tmp_path_factory.mktemp("w4") / "smollm", config, weights, tok, "w4", calib, SEQ,
                                   False, block_size=32, source=smollm_gguf)
    qconfig, qweights, _ = load_model(folder)
    runner = build_runner(qconfig, qweights, "emulator", SEQ)
    got = runner.prefill(held, runner.new_cache())
    return held, ref, got, folder, plan, runner, weights


def _ppl(logits, ids):
    return float(np.exp(token_nll(logits[:-1], np.asarray(ids[1:])).mean()))


def test_the_gguf_blocks_are_taken_as_they_are(runs):
    """The 210 Q4_1 linears' blocks as they are; the Q8_0 embedding, requantized as int8 blocks
    of 32, is the GGUF's own, bit for bit (its largest |q| is 127, its d an fp16)."""
    import json

    from safetensors.numpy import load_file

    from anelm.models.formats.quantized import dequantize_blocks8

    folder, weights = runs[3], runs[6]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["blocks"] == {"Q4_1": 210} and qc["block_size"] == 32
    t = load_file(str(folder / "model.safetensors"))
    emb = "model.embed_tokens.weight"
    assert t[emb].dtype == np.int8
    assert np.array_equal(dequantize_blocks8(t[emb], t["model.embed_tokens.weight_scale"]), weights[emb])


def test_logits_equal_the_gguf_dequantized_within_fp16_rounding(runs):
    held, ref, got = runs[:3]
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-2, err
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() == 1.0


def test_perplexity_within_three_percent_and_size_under_forty(runs):
    held, ref, got, folder, _, _, weights = runs
    ratio = _ppl(got, held) / _ppl(ref, held)  # measured 27.410 / 27.425 = 0.9995
    assert abs(ratio - 1) < 0.03, ratio
    fp16 = device_bytes(weights)  # every weight at 2 bytes: 269 MB
    size = sum(f.stat().st_size for f in folder.iterdir())  # 100.2 MB with the tokenizer: 37 %
    assert size < 0.40 * fp16, (size, fp16)


def test_the_programs_hold_4bit_blobs(runs):
    runner = runs[5]
    art = next(k for key, k in runner.kernels.items() if key[0] == "prefill").artifact
    assert "data = tensor<uint4, [1536, 576, 1, 1]>(BLOBFILE" in art.mil_text  # gate and up
    assert "tensor<fp16, [1536, 576, 1, 1]>(BLOBFILE" not in art.mil_text  # no fp16 copy of them
    data = sum(len(bytes(b)) for p, b in art.weights.items() if p.endswith("_w4_data.bin"))
    assert data < 128 * 7 + (576 * 960 + 576 * 576 + 3 * 576 * 1536) // 2 + 1  # half a byte a weight
