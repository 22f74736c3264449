"""W4 and LUT4 for Gemma 3 (docs/quantization.md), on the emulator under `strict`.

What Gemma changes for 4-bit weights (test_quantize_gemma3.py's module doc has it for int8): the
norm gains 1 + w go on the linears' inputs, not into the 4-bit blocks or tables; the post-norms
stay elementwise, carrying the stream scale; o and down feed the post-norms.

* A tiny random Gemma 3 through `anelm quantize` (W4 in blocks of 16, LUT4 at its defaults):
  the device's logits against the CPU reference on the folder's dequantized weights, the 3e-2
  of docs/testing.md for a whole tiny model's logits (measured: W4 7.4e-3, LUT4 3.8e-3), the programs
  carrying the folder's 4-bit data. So the device runs Gemma's 4-bit folders as their weights say.
* Gemma 3 270M (Q4_K_M GGUF, the test extras), the W8 test's window: BOS and the 255 tokens of
  the Apache license after its first 256 are scored, one 256-token window, which fills its
  prefill bucket. W4 calibrates on those first 256 tokens; LUT4 on 512, the 256 after the window
  added, so that `quantize` chooses its tables on a held-out part of the calibration (its last
  128 tokens, after BOS: quant/w8a8.held_part), as a user's run does (--calib-tokens defaults to
  4096). Measured: source 16.947, W4 (blocks of 32 fitted on the calibration's input moments,
  quant/w4.py) 17.146 = x1.012, LUT4 17.507 = x1.033 (tables per row and 64 inputs, chosen: on
  the CPU reference the held-out part measured x1.062 at 192 inputs and x0.992 at 64, a part
  that calibrated the tables too); folders 201.1 MB (W4) and 312.0 MB (LUT4) against 536.2 MB of
  fp16 weights: 37.5 % and 58.2 %; nothing overflows fp16. W4's folder: the tied embedding (168M
  of the 268M weights) in 4-bit blocks of 32 fitted on the head's input moments (as int8 blocks
  it is 33 % alone and the folder 51 %). Before: min..max blocks x1.150 (the GGUF's Q5_0, Q8_0,
  Q4_K and Q6_K linears are requantized; SmolLM2's GGUF is Q4_1, whose blocks W4 takes as they
  are).
  LUT4's indices follow GPTQ's order under each linear's input covariance (quant/gptq.py), the
  k-means tables kept. Each weight's nearest entry instead measured x1.052 here, the same tables
  (x1.052-1.054 on the float32 CPU for calibrations of 512 to 2068 tokens; x1.036 when the first
  256 alone calibrated tables per 64 inputs, that text's luck), over the 5 % (a strict expected
  failure until this). On the float32 CPU, GPTQ's order: x1.033 at 64 inputs, x1.047 at 192.
  The measured ratio is held as an upper bound beside the limit, so that losing part of the
  gain shows before the limit does.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402
from helpers import device_against_cpu  # noqa: E402

from anelm.cli.main import main  # noqa: E402
from anelm.device.overflow import reset_overflow_warnings  # noqa: E402
from anelm.generate.perplexity import perplexity  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402
from anelm.quant.command import build_folder, device_bytes  # noqa: E402

SEQ = 256  # calibration and the scored window; a prefill bucket of the 256-context plan
LIMITS = {"w4": 0.03, "lut4": 0.05}  # |ratio - 1| against the unquantized model on the device
CARRIES = {"w4": "data = tensor<uint4, [128, 64, 1, 1]>(BLOBFILE",  # tiny gate and up: 4-bit
           "lut4": "indices = tensor<uint4, [128, 64, 1, 1]>(BLOBFILE"}


# --- a tiny random Gemma 3 -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{scheme: its folder} of a tiny random Gemma 3 with a word-level tokenizer."""
    d, text = hf_tiny.word_model_and_text(tmp_path_factory.mktemp("gemma3_4bit"), "gemma3")
    out = {}
    for scheme, extra in (("w4", ["--block-size", "16"]), ("lut4", [])):
        out[scheme] = d.parent / scheme
        assert main(["quantize", "--model", str(d), "--out", str(out[scheme]), "--scheme", scheme, *extra,
                     "--data", str(text), "--calib-tokens", "128", "--eval-tokens", "64", "--device", "emulator"]) == 0
    return out


@pytest.mark.parametrize("scheme", ["w4", "lut4"])
def test_tiny_logits_against_the_cpu_reference(tiny, scheme):
    config, weights, _ = load_model(tiny[scheme])
    assert config.model_type == "gemma3_text" and weights.quant.scheme == scheme
    assert device_against_cpu(config, weights) <= 3e-2  # docs/testing.md: a whole tiny model's logits
    runner = build_runner(config, weights, "emulator", max_context=32)
    runner.prefill([5, 6, 7], runner.new_cache())
    art = next(k for key, k in runner.kernels.items() if key[:2] == ("prefill", 0)).artifact
    assert CARRIES[scheme] in art.mil_text and "tensor<fp16, [128, 64, 1, 1]>(BLOBFILE" not in art.mil_text


def test_fitted_blocks_err_less_than_min_max(tiny):
    """quant/w4.py's fit_blocks: on the tiny Gemma's linears, with its inputs' moments, each
    linear's moment-weighted squared error is under min..max's; a Q4_1 grid comes back exactly."""
    from anelm.models.formats.quantized import linear_names, quantize_blocks
    from anelm.quant.lut import input_moments
    from anelm.quant.w4 import fit_blocks

    config, weights, _ = load_model(tiny["w4"].parent / "model")
    moments = input_moments(config, weights, np.random.default_rng(4).integers(3, 96, 64).tolist(), 64)
    for n in linear_names(config):
        w, a = weights[n + ".weight"], moments[n]
        err = {f: float((a * (q.dense() - w) ** 2).sum()) for f, q in
               (("fit", fit_blocks(w, 16, a)), ("minmax", quantize_blocks(w, 16)))}
        assert err["fit"] < err["minmax"], (n, err)
    rng = np.random.default_rng(6)
    q = rng.integers(0, 16, (8, 64)).astype(np.float32)
    q[:, ::16], q[:, 1::16] = 0, 15  # every block uses both ends
    d = np.repeat((rng.uniform(1, 2, (8, 4)) * 2.0 ** -8).astype(np.float16).astype(np.float32), 16, axis=1)
    m = np.repeat(-(rng.uniform(0, 8, (8, 4)) * 2.0 ** -8).astype(np.float16).astype(np.float32), 16, axis=1)
    bq = fit_blocks(d * q + m, 16, rng.uniform(0.1, 2, 64))
    assert np.array_equal(bq.data, q.astype(np.uint8))


# --- Gemma 3 270M ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scored(gemma, gemma_apache, tmp_path_factory):
    """({"source", "w4", "lut4": perplexity of the held-out window}, {scheme: folder bytes}, the
    fp16 weights' bytes, what the device printed on stderr, {scheme: its quantization_config})."""
    config, weights, tok = gemma
    ids, calib, held, source, source_err = gemma_apache  # the unquantized model scored once (real_models)
    assert held == ids[:1] + ids[SEQ:2 * SEQ - 1] and held[0] == config.bos_token_id
    # lut4 chooses its tables on the last quarter of its calibration (quant/lut.py), which needs
    # 512 tokens: the 256 before the window and the 256 after it, the window itself left out
    calibs = {"w4": calib, "lut4": calib + ids[2 * SEQ - 1:3 * SEQ - 1]}
    reset_overflow_warnings()  # each kernel warns once per process: as a fresh process would
    err, ppl, size, qcs = io.StringIO(), {"source": source}, {}, {}
    with contextlib.redirect_stderr(err):
        for scheme in LIMITS:
            folder, _, _ = build_folder(tmp_path_factory.mktemp("q") / scheme, config, weights, tok, scheme,
                                        calibs[scheme], SEQ, False)
            size[scheme] = sum(f.stat().st_size for f in folder.iterdir())  # tokenizer included
            qcs[scheme] = json.loads((folder / "config.json").read_text())["quantization_config"]
            print(scheme, {k: qcs[scheme].get(k) for k in ("tables", "block_size", "chosen_on")})
            qconfig, qweights, _ = load_model(folder)
            runner = build_runner(qconfig, qweights, "emulator", SEQ)
            ppl[scheme] = perplexity(runner, held, SEQ, False).ppl
            runner.close()
            shutil.rmtree(folder)
    fp16 = device_bytes(weights)
    print("Gemma 3 270M:", {k: f"{v:.3f} (x{v / ppl['source']:.3f})" for k, v in ppl.items()},
          {k: f"{v / 1e6:.1f} MB = {v / fp16:.1%} of fp16" for k, v in size.items()})
    return ppl, size, fp16, source_err + err.getvalue(), qcs


@pytest.mark.parametrize("scheme", ["w4", "lut4"])
def test_perplexity_within_the_limit(scored, scheme):
    ppl = scored[0]
    assert abs(ppl[scheme] / ppl["source"] - 1) <= LIMITS[scheme], ppl


def test_lut4_perplexity_as_measured(scored):
    """No worse than measured (x1.033; +0.01 for a change of rounding): the nearest table entries
    (x1.052), a Gemma path gone wrong (a gain w for 1 + w, a stream scale lost) and the tables per
    192 inputs the choice turned down are all worse."""
    assert scored[0]["lut4"] / scored[0]["source"] <= 1.033 + 0.01, scored[0]


def test_w4_folder_under_forty_percent_of_fp16(scored):
    assert scored[1]["w4"] < 0.40 * scored[2], (scored[1], scored[2])


def test_nothing_overflows_fp16(scored):
    assert "fp16 overflow" not in scored[3], scored[3]  # the device warns of any fp16 overflow


def test_lut4_tables_chosen_on_held_out_calibration(scored):
    assert "chosen_on" in scored[4]["lut4"], scored[4]["lut4"]  # as a user's run with --calib-tokens 512 or more
