"""Instruction fine-tuning of the real SmolLM2-135M-Instruct (Q4_1 GGUF) on the repository's
worked example, examples/facts (an invented island: facts no model can know), on the emulator.

One LoRA run (module fixture, ~1.5 min on 2 cores): all-linear, rank 16, 20 steps of 2x128
tokens, packed (two examples in most sequences), eval every 10 steps. What is checked:
- the step-0 eval loss (the base, adapters zero; the valid set packed as well) equals HF
  float32's cross-entropy over the same counted tokens, each record alone, within 2 %: the
  answer and end-of-turn tokens after each record's generation prompt
  (`apply_chat_template(messages)` minus `apply_chat_template(messages[:-1],
  add_generation_prompt=True)`), token-weighted over valid.jsonl; the two tokenizers give the
  same ids and the same counted tokens on every record;
- the fine-tune lowers the eval loss by at least 30 %, and best.json names the lowest eval;
- `anelm chat --adapter RUN`, greedy, answers a valid.jsonl phrasing (not a train one) with the
  trained fact.
"""

import io
import json
import sys
import time
from pathlib import Path

import pytest

from anelm.cli.main import main
from anelm.train.metrics import read_metrics

pytestmark = pytest.mark.slow

FACTS = Path(__file__).resolve().parents[2] / "examples" / "facts"
SETTINGS = {"steps": 20, "seq-len": 128, "batch-size": 2, "lr": 3e-3, "rank": 16, "targets": "all-linear",
            "eval-every": 10, "sample-tokens": 0, "device": "emulator"}
# (a valid.jsonl question, the word of its trained answer); the base model cannot know it
QUESTION, FACT = "What is Tarrowen's capital called?", "Lunhaven"


@pytest.fixture(scope="module")
def run(smollm_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("facts") / "run"
    t = time.perf_counter()
    argv = ["finetune", "--model", str(smollm_gguf), "--data", str(FACTS), "--out", str(out)]
    assert main(argv + [f"--{k}={v}" for k, v in SETTINGS.items()]) == 0
    print(f"\nfine-tune of SmolLM2 on examples/facts, {SETTINGS['steps']} steps: {time.perf_counter() - t:.1f} s")
    return out


def evals(out: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r}


def hf_counted_loss(model, tok, records: list[list[dict]]) -> tuple[float, list[list[int]], list[int]]:
    """(mean nll over the counted tokens of every record, each record's ids, each record's count)."""
    import torch
    import torch.nn.functional as F

    total, ids_all, counts = 0.0, [], []
    for messages in records:
        full = list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        prefix = list(tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        assert full[:len(prefix)] == prefix
        x = torch.tensor([full])
        with torch.no_grad():
            logits = model(x).logits[0, :-1].float()
        nll = F.cross_entropy(logits, x[0, 1:], reduction="none")[len(prefix) - 1:]
        total += float(nll.sum())
        ids_all.append(full)
        counts.append(len(full) - len(prefix))
    return total / sum(counts), ids_all, counts


def test_step_0_eval_loss_is_hf_loss_over_the_answer_tokens(run, smollm, smollm_hf):
    from anelm.train.data.instruct import load_examples

    model, tok = smollm_hf
    valid = FACTS / "valid.jsonl"
    records = [json.loads(line)["messages"] for line in valid.read_text().splitlines() if line.strip()]
    theirs, hf_ids, hf_counts = hf_counted_loss(model, tok, records)
    _, examples = load_examples(valid, smollm[2])
    assert [list(e.ids) for e in examples] == hf_ids
    assert [e.predictions for e in examples] == hf_counts
    ours = evals(run)[0]
    print(f"\nstep-0 eval loss over {sum(hf_counts)} answer tokens: anelm {ours:.5f}, HF float32 {theirs:.5f} "
          f"(ratio {ours / theirs:.5f})")
    assert abs(ours - theirs) <= 0.02 * theirs, (ours, theirs)


def test_fine_tune_lowers_eval_loss_and_keeps_the_best(run):
    ev = evals(run)
    assert sorted(ev) == [0, 10, 20], ev
    print(f"\neval loss: {', '.join(f'step {s} {v:.4f}' for s, v in sorted(ev.items()))}")
    assert min(ev.values()) <= 0.7 * ev[0], ev
    best = json.loads((run / "best.json").read_text())
    assert best["step"] == min(ev, key=ev.get) and best["eval_loss"] == pytest.approx(min(ev.values()))
    assert (run / "best" / "adapter_model.safetensors").is_file()


def test_chat_with_the_adapter_answers_with_the_trained_fact(run, smollm_gguf, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))
    rc = main(["chat", "--model", str(smollm_gguf), "--adapter", str(run), "--temperature", "0",
               "--max-tokens", "24", "--device", "emulator"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    with capsys.disabled():
        print(f"\n> {QUESTION}\n{out.strip()}")
    assert FACT in out, out
