"""W8A8's smoothing fold (anelm/quant/smooth.py) on tiny random models: the folded float model
is the unfolded one (before any int8 rounding, up to float32 round-off), for each place a
factor is folded into (a norm's gain, LayerNorm's shift, v's rows per KV group, up's rows,
GPT-2's fused c_attn), and the smoothed inputs' ranges are the calibrated ones divided by s.
One W8A8 linear in two int8 products runs on the emulator as the integer reference computes it,
and a tiny Llama (GQA) quantized with smoothing and two products keeps them through its folder.
"""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
import hf_tiny  # noqa: E402
from helpers import rel_err  # noqa: E402

from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.models.loading import build_model, load_model  # noqa: E402
from anelm.quant import smooth, w8a8  # noqa: E402
from anelm.quant.command import build_folder  # noqa: E402
from anelm.quant.calibrate import calibrate  # noqa: E402

IDS = np.random.default_rng(7).integers(3, 96, 48).tolist()


@pytest.fixture(scope="module", params=["llama-gqa", "gpt2", "gemma3"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("smooth") / request.param
    hf_tiny.make_word_model(d, kind=request.param)
    config, weights, _ = load_model(d)
    chan, _ = calibrate(config, weights, IDS, 64, None, False)
    return config, dict(weights), chan


def logits(config, weights):
    m = build_model(config, weights)
    return m.prefill(IDS, m.new_cache())


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_the_folded_float_model_is_the_unfolded_one(model, alpha):
    config, weights, chan = model
    fs = {s: smooth.factors(s, chan, weights, alpha) for s in smooth.sites(config)}
    assert {s.kind for s in fs} == ({"norm", "o"} if config.model_type == "gpt2" else {"norm", "o", "down"})
    assert max(float(np.abs(np.log(s)).max()) for s in fs.values()) > 0.3  # factors away from 1: a real test
    folded = smooth.fold(config, weights, fs)
    changed = [k for k in weights if not np.array_equal(folded[k], weights[k])]
    assert len(changed) > 4 * config.num_hidden_layers
    assert rel_err(logits(config, folded), logits(config, weights)) < 1e-5  # float32 round-off


def test_smoothed_ranges_are_the_calibrated_ones_over_s(model):
    config, weights, chan = model
    fs = {s: smooth.factors(s, chan, weights, 0.5) for s in smooth.sites(config)}
    measured, _ = calibrate(config, smooth.fold(config, weights, fs), IDS, 64, None, False)
    predicted = smooth.smoothed_ranges(chan, fs)
    for n, c in measured.items():
        np.testing.assert_allclose(c, predicted[n], rtol=1e-4, atol=1e-6, err_msg=n)


def test_kv_groups_share_their_factors():
    """o's input channel h·hd + d comes from kv head h // group's v row: one factor for the group."""
    site = smooth.Site("o", ("o",), "v", False, None, group=4, head_dim=3)
    chan = {"o": np.arange(1, 2 * 4 * 3 + 1, dtype=np.float32)}  # 2 kv heads, 4 heads each, hd 3
    w = {"o.weight": np.ones((5, 24), np.float32)}
    s = smooth.factors(site, chan, w, 1.0)
    assert s.shape == (6,)  # one per v row
    spread = smooth._spread(s, site).reshape(2, 4, 3)
    assert (spread == spread[:, :1]).all()
    # each group's factor follows its largest range: heads 3 and 7 (the last of each group)
    ratio = s.reshape(2, 3) / s.reshape(2, 3)[0, 0]
    np.testing.assert_allclose(ratio[0], np.array([10, 11, 12]) / 10, rtol=1e-6)


def test_two_int8_products_on_the_emulator():
    """One W8A8 linear in two products (kernels/qlinear.py): the emulator's output is the integer
    reference's: q·q1·f + q·q2·s, each row times its scale, q1 the fine int8 (saturating on
    the tail), q2 what it left at the coarse scale, up to the fp16 roundings of the output."""
    from anelm.chip.profile import STRICT
    from anelm.compiler.pipeline import compile_graph
    from anelm.device.emulator import Emulator
    from anelm.ir.builder import GraphBuilder
    from anelm.kernels.qlinear import QLinear, quant_linear
    from anelm.runtime.kernel import Kernel

    rng = np.random.default_rng(4)
    c, o, t = 64, 24, 16
    q = rng.integers(-127, 128, (o, c)).astype(np.int8)
    scale = (rng.uniform(0.5, 1.5, o) / 127 / 8).astype(np.float32)
    x = rng.standard_normal((c, t)).astype(np.float16)
    x[rng.integers(0, c, 6), rng.integers(0, t, 6)] = [40, -35, 60, -50, 30, 45]  # the tail
    f, s = np.float16(2.0 / 127), np.float16(2 * 60.0 / 127)  # bulk within ±2, all within ±120
    b = GraphBuilder("int8")
    xin = b.input("x", [1, c, 1, t])
    b.output("y", quant_linear(b, xin, QLinear(q, scale, act_scale=(float(f), float(s))), None, "lin"))
    art = compile_graph(b.build(), STRICT)
    got = Kernel(art, Emulator(STRICT))(x=x.reshape(1, c, 1, t))["y"].reshape(o, t).astype(np.float64)
    q1 = np.clip(np.rint(x.astype(np.float64) / f), -128, 127)
    rest = (x - (q1 * f).astype(np.float16)).astype(np.float16)  # fp16, as the graph's sub
    q2 = np.clip(np.rint(rest.astype(np.float64) / s), -128, 127)
    assert np.abs(q2).max() >= 1 and np.abs(q1).max() == 128  # both products carry something
    rows = scale.astype(np.float16).astype(np.float64)[:, None]
    want = (q.astype(np.float64) @ q1) * float(f) * rows + (q.astype(np.float64) @ q2) * float(s) * rows
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert "lin_xq1 = quantize(" in art.mil_text and art.mil_text.count("constexpr_affine_dequantize(") == 1


def test_a_folder_with_smoothing_and_two_products(tmp_path, monkeypatch):
    """What `quantize` chose is what the folder holds and the kernels run: the input scales
    read back (`input_fine_scale`), a second product in the programs."""
    monkeypatch.setattr(w8a8, "FINE", (8,))  # the choice: both measures, whatever they score
    monkeypatch.setattr(w8a8, "ALPHAS", (0.5,))
    d = tmp_path / "llama"
    hf_tiny.make_word_model(d)  # GQA: 8 heads on 2 kv heads, o's factors shared per group
    config, weights, tok = load_model(d)
    calib = np.random.default_rng(3).integers(3, 96, 4 * w8a8.MIN_SELECT).tolist()
    folder, plan, _ = build_folder(tmp_path / "q", config, weights, tok, "w8a8", calib, 64, False)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]["w8a8"]
    assert qc["alpha"] == {"norm": 0.5, "o": 0.5, "down": 0.5} and qc["fine_ratio"] == 8
    assert qc["chosen_on_tokens"] == w8a8.MIN_SELECT and len(qc["candidates"]) == 4  # FINE's one, then one per kind
    qconfig, qweights, _ = load_model(folder)
    for n, iq in plan.inputs.items():
        back = qweights.quant.inputs[n]
        assert iq.fine is not None and (back.fine, back.act_scale) == (np.float32(iq.fine), np.float32(iq.act_scale))
        assert iq.act_scale == pytest.approx(w8a8.HEADROOM * 8 * iq.fine)
    runner = build_runner(qconfig, qweights, "emulator", max_context=64)
    assert np.isfinite(runner.prefill(IDS, runner.new_cache())).all()
    art = runner.kernels[next(k for k in runner.kernels if k[:2] == ("prefill", 0))].artifact
    assert "_xq1 = quantize(" in art.mil_text
