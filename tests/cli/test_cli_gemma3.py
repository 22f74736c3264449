"""The commands on a Gemma 3 (a tiny random one in an HF folder, with a word-level tokenizer):
`finetune` writes a PEFT adapter, `export --merge` writes an HF folder that transformers loads
as `Gemma3ForCausalLM` and that equals PEFT's base + adapter, `perplexity --adapter` agrees with
PEFT, and `generate --json` reports the stream scale (docs/fine-tuning.md, docs/models.md)."""

import json

import numpy as np
import pytest

import hf_tiny
from lora_tiny import peft, torch

from anelm.cli.main import main

NLL_TOL = 1e-2  # as test_cli_lora: the emulator's fp16 logits, averaged over ~60 predictions
FP32_TOL = 1e-4  # a merged float32 model against PEFT's float32 base + adapter


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base folder, finetune RUN folder, text file, word ids)."""
    root = tmp_path_factory.mktemp("gemma-cli")
    base = root / "base"
    hf_tiny.make_word_model(base, seed=6, kind="gemma3")
    ids = np.random.default_rng(8).integers(3, 96, 400).tolist()
    text = root / "text.txt"
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    run = root / "run"
    assert main(["finetune", "--model", str(base), "--data", str(text), "--steps", "3", "--seq-len", "32",
                 "--targets", "all-linear", "--out", str(run), "--device", "emulator"]) == 0
    return base, run, text, ids


def test_finetune_adapter_loads_in_peft_and_perplexity_agrees(world, capsys):
    import transformers

    base, run, text, ids = world
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    pm = peft.PeftModel.from_pretrained(hf, run / "adapter").eval()
    ref_nll = hf_tiny.hf_windows(pm, ids[:64], 64)[0]
    capsys.readouterr()
    assert main(["perplexity", "--model", str(base), "--adapter", str(run), "--data", str(text),
                 "--max-tokens", "64", "--seq-len", "64", "--json", "--device", "emulator"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert abs(res["nll"] - ref_nll) <= NLL_TOL * abs(ref_nll), (res["nll"], ref_nll)


def test_export_merge_is_an_hf_gemma3_folder(world, tmp_path):
    import transformers

    base, run, _, ids = world
    out = tmp_path / "merged"
    assert main(["export", str(run), "--merge", "--out", str(out)]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), run / "adapter")
    with torch.no_grad():
        got = merged(torch.tensor([ids[:40]])).logits.numpy()
        ref = pm.eval()(torch.tensor([ids[:40]])).logits.numpy()
    assert np.abs(got - ref).max() / np.abs(ref).max() <= FP32_TOL


def test_generate_json_reports_the_stream_scale(world, capsys):
    base, _, _, _ = world
    capsys.readouterr()
    assert main(["generate", "--model", str(base), "--prompt", "w5 w9 w12", "--max-tokens", "4",
                 "--temperature", "0", "--json", "--device", "emulator"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["stream_scale"] == 1.0 and len(res["ids"]) == 4  # a random model's stream is small
