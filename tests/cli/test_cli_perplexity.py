"""`anelm perplexity` (docs/models.md) on a tiny model with a word-level tokenizer, against HF
transformers in float32 scoring the same windows."""

import json
import math

import numpy as np
import pytest

import hf_tiny
from helpers import decisive

pytest.importorskip("transformers")

from anelm.cli.main import main  # noqa: E402

KEYS = {"tokens", "windows", "predictions", "nll", "ppl", "argmax", "device", "stream_scale"}  # docs/models.md
# a random tiny model on the fp16 emulator: its logits are within 3e-2 of max|logit| (docs/testing.md), and
# the mean nll over ~100 predictions moves by far less than that
NLL_TOL = 1e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl") / "llama"
    hf = hf_tiny.make_word_model(d)
    ids = np.random.default_rng(7).integers(3, 96, 100).tolist()
    text = d.parent / "text.txt"
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    return d, hf, text, ids


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_scores_each_window_as_hf_does(model, capsys):
    d, hf, text, ids = model
    rc, out, _ = cli(capsys, "perplexity", "--model", str(d), "--data", str(text), "--seq-len", "32",
                     "--max-tokens=97", "--json")
    assert rc == 0 and out.count("\n") == 1
    res = json.loads(out)
    assert set(res) == KEYS and res["device"] == "emulator"
    # 97 tokens in windows of 32: 32 + 32 + 32 + 1, and the last (one token) predicts nothing
    assert res["tokens"] == ids[:96] and res["windows"] == 3 and res["predictions"] == 93
    ref_nll, rows = hf_tiny.hf_windows(hf, ids[:97], 32)
    ref = np.concatenate(rows)  # [93, V]
    firm = [i for i, row in enumerate(ref) if decisive(row)]  # HF's top-2 margin rule (docs/testing.md)
    assert len(res["argmax"]) == 93 and len(firm) >= 40
    assert [res["argmax"][i] for i in firm] == [int(ref[i].argmax()) for i in firm]
    assert abs(res["nll"] - ref_nll) <= NLL_TOL
    assert res["ppl"] == pytest.approx(math.exp(res["nll"]))


def test_plain_output_is_one_line(model, capsys):
    d, _, text, _ = model
    rc, out, err = cli(capsys, "perplexity", "--model", str(d), "--data", str(text), "--seq-len", "64")
    assert rc == 0
    line, = out.splitlines()
    assert line.startswith("perplexity ") and line.endswith("nats over 98 predictions)")  # 64 + 36 tokens


@pytest.mark.parametrize("argv, says", [
    (["--data", "missing.txt"], "data file not found"),
    (["--seq-len", "1"], "at least 2 tokens"),
    (["--seq-len", "65"], "exceeds the model's context of 64"),
    (["--seq-len", "0"], "expected a positive integer"),
])
def test_bad_input_is_one_line(model, capsys, tmp_path, argv, says):
    d, _, text, _ = model
    args = ["perplexity", "--model", str(d), "--data", str(text)] + argv
    if "missing.txt" in argv:
        args[args.index("missing.txt")] = str(tmp_path / "missing.txt")
    rc, out, err = cli(capsys, *args)
    assert rc in (1, 2) and out == ""
    line, = err.strip().splitlines()[-1:]
    assert line.startswith("anelm: error:") and says in line
    assert "Traceback" not in err


def test_text_that_is_not_utf8_is_refused(model, capsys, tmp_path):
    d, _, _, _ = model
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 w5 w6".encode("latin-1"))
    rc, _, err = cli(capsys, "perplexity", "--model", str(d), "--data", str(bad))
    assert rc == 1 and "is not UTF-8 text" in err


def test_without_a_terminal_progress_is_notice_lines(model, capsys, monkeypatch):
    """stderr that is not a terminal (a log, a pipe) got nothing for minutes of a cold
    run; now a line at the start and one about every NOTICE_EVERY_S (0 here: each window)."""
    from anelm.generate import perplexity

    monkeypatch.setattr(perplexity, "NOTICE_EVERY_S", 0.0)
    d, _, text, _ = model
    rc, out, err = cli(capsys, "perplexity", "--model", str(d), "--data", str(text), "--seq-len", "32")
    lines = [line for line in err.splitlines() if line.startswith("anelm: perplexity:")]
    assert rc == 0 and lines[0] == "anelm: perplexity: 96 predictions in 4 window(s) of up to 32 tokens"
    assert [line.split(",")[0] for line in lines[1:]] == [f"anelm: perplexity: window {k}/4" for k in (1, 2, 3)]
    assert lines[1].startswith("anelm: perplexity: window 1/4, 31/96 predictions, ppl ") and "so far" in lines[1]
    assert "\r" not in err  # no bar
