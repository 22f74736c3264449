"""`anelm perplexity --data FILE.jsonl` (docs/fine-tuning.md): the real SmolLM2-135M-Instruct GGUF on
the emulator scores only the assistant's answers of a small chat file, and agrees with HF
transformers in float32 (HF's own chat template, loss over the answer tokens, token-weighted
over the file) within 1 %. A bad line is one error line before any model loads. Records longer
than the window are scored in windows, only counted targets adding (a bigram table as the model);
--max-tokens and --train-on-prompt on a tiny HF model."""

import json
import subprocess
import sys
from collections.abc import Mapping

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.generate.perplexity import perplexity, score_records
from instruct_tiny import CONVERSATIONS

NLL_TOL = 0.01  # docs/testing.md: a real model on the device is within 1 % of HF float32


def hf_ids(hf_tok, messages, generation_prompt):
    out = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def hf_answer_nll(model, hf_tok, messages):
    """(summed nll in nats over the last answer's tokens, their count) by HF in float32."""
    import torch

    full, prefix = hf_ids(hf_tok, messages, False), hf_ids(hf_tok, messages[:-1], True)
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].double()
    targets = torch.tensor(full[len(prefix):])
    nll = torch.nn.functional.cross_entropy(logits[len(prefix) - 1:-1], targets, reduction="sum")
    return float(nll), len(targets), full


def test_chat_answers_score_as_hf_does(smollm_gguf, smollm_hf, tmp_path, capsys):
    model, hf_tok = smollm_hf
    data = tmp_path / "chat.jsonl"
    rows = [json.dumps({"messages": m, "id": k}) for k, m in enumerate(CONVERSATIONS)]
    data.write_text("\n".join(rows[:2] + [""] + rows[2:]) + "\n")  # a blank line: records keep their lines
    rc = main(["perplexity", "--model", str(smollm_gguf), "--data", str(data), "--seq-len", "128",
               "--device", "emulator", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    ref = [hf_answer_nll(model, hf_tok, m) for m in CONVERSATIONS]
    ref_nll = sum(s for s, _, _ in ref) / sum(n for _, n, _ in ref)
    assert res["tokens"] == [t for _, _, full in ref for t in full]  # HF's template, token for token
    assert res["windows"] == len(CONVERSATIONS) and res["predictions"] == sum(n for _, n, _ in ref)
    lines = [1, 2] + list(range(4, len(CONVERSATIONS) + 2))  # the blank third line holds no record
    assert [(r["line"], r["predictions"]) for r in res["records"]] == list(zip(lines, [n for _, n, _ in ref]))
    assert abs(res["nll"] / ref_nll - 1) <= NLL_TOL, f"nll {res['nll']:.5f} against HF's {ref_nll:.5f}"
    mean = sum(r["nll"] * r["predictions"] for r in res["records"]) / res["predictions"]
    assert mean == pytest.approx(res["nll"]) and res["ppl"] == pytest.approx(np.exp(res["nll"]))
    assert "fp16 overflow" not in err


def test_a_bad_line_is_one_error_before_the_model_loads(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" +
                    json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    # a model path that is not there: had the model loaded first, the error would name it
    run = subprocess.run([sys.executable, "-m", "anelm", "perplexity", "--model", str(tmp_path / "no-model"),
                          "--data", str(data)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.strip() == (f"anelm: error: {data}:2: messages[0] has role 'robot'; "
                                  "expected one of system, user, assistant")


class Bigram:
    """A runner whose logits at each position depend only on that position's token."""

    device = "cpu"

    def __init__(self, vocab=30, seed=0):
        self.table = np.random.default_rng(seed).normal(size=(vocab, vocab)) * 3

    def new_cache(self):
        return None

    def prefill(self, ids, cache):
        return self.table[np.asarray(ids)]

    def nll(self, prev, nxt):
        row = self.table[prev]
        return float(np.log(np.exp(row - row.max()).sum()) + row.max() - row[nxt])


def test_records_score_in_windows_and_only_counted_targets_add():
    runner, rng = Bigram(), np.random.default_rng(1)
    records = []
    # 23 tokens: windows of 8, 8 and 7; 9: 8 and a last one of 1, dropped; 1 token: none
    for line, n in ((1, 5), (3, 23), (4, 9), (6, 1)):
        ids = rng.integers(0, 30, n).tolist()
        counted = rng.random(n) < 0.6
        counted[:2] = [False, True][:n]  # the first predicts nothing; the second: a count in every record
        records.append((line, ids, counted))
    score = score_records(runner, records, 8, progress=False)
    sums, counts = [], []
    for _, ids, counted in records:
        # a target at a window's first position (8, 16) has nothing before it in its window
        js = [j for j in range(1, len(ids)) if counted[j] and j % 8]
        sums.append(sum(runner.nll(ids[j - 1], ids[j]) for j in js))
        counts.append(len(js))
    assert score.windows == 1 + 3 + 1 and score.predictions == sum(counts)
    assert score.nll == pytest.approx(sum(sums) / sum(counts))
    assert [(r.line, r.tokens, r.predictions) for r in score.records] == [
        (1, 5, counts[0]), (3, 23, counts[1]), (4, 8, counts[2]), (6, 0, 0)]
    assert [r.nll for r in score.records[:3]] == pytest.approx([s / n for s, n in zip(sums[:3], counts[:3])])
    assert score.records[3].nll is None
    assert len(score.argmax) == len(score.tokens) - score.windows  # every position but each window's last
    _, ids, _ = records[1]
    every = score_records(runner, [(1, ids, [False] + [True] * (len(ids) - 1))], 8, progress=False)
    text = perplexity(runner, ids, 8, progress=False)  # all counted: the text path's numbers
    assert (every.nll, every.predictions, every.tokens, every.argmax) == (text.nll, text.predictions,
                                                                          text.tokens, text.argmax)


def test_max_tokens_and_train_on_prompt_on_a_tiny_model(tmp_path, capsys):
    hf_tiny = pytest.importorskip("hf_tiny")
    import torch

    hf = hf_tiny.make_word_model(tmp_path / "llama")
    rng = np.random.default_rng(4)
    words = lambda n: " ".join(f"w{i}" for i in rng.integers(3, 96, n))  # noqa: E731
    records = [{"prompt": words(6), "completion": words(4)}, {"prompt": words(3), "completion": words(20)}]
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def score(*flags):
        rc = main(["perplexity", "--model", str(tmp_path / "llama"), "--data", str(data), "--seq-len", "16",
                   "--json", *flags])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out)

    def ref(ids, first_counted):  # HF's nll over targets first_counted.. of one window
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        nll = torch.nn.functional.cross_entropy(logits[first_counted - 1:-1], torch.tensor(ids[first_counted:]),
                                                reduction="sum")
        return float(nll), len(ids) - first_counted

    ids = [[int(w[1:]) for w in (r["prompt"] + " " + r["completion"]).split()] + [2] for r in records]
    res = score()
    assert res["tokens"] == ids[0] + ids[1][:16] + ids[1][16:]  # the second record: windows of 16 and 8
    assert [r["predictions"] for r in res["records"]] == [5, 21 - 1]  # its token 16 starts a window
    s0, n0 = ref(ids[0], 6)
    assert res["records"][0]["nll"] == pytest.approx(s0 / n0, abs=1e-2)
    res = score("--train-on-prompt")
    assert [r["predictions"] for r in res["records"]] == [10, 15 + 7]
    res = score("--max-tokens", "14")  # the first record's 11 tokens, then 3 of the second's prompt
    assert res["tokens"] == ids[0] + ids[1][:3] and res["predictions"] == 5
    assert [r["predictions"] for r in res["records"]] == [5, 0] and res["records"][1]["nll"] is None
