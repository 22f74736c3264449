"""`--adapter` on perplexity, generate and chat, and `anelm export` of a finetune RUN folder
(docs/fine-tuning.md), against HF transformers + PEFT in float32. The RUN folders are built by hand as
`anelm finetune` leaves them: an `anelm train` run (config.json, tokenizer.json, a checkpoint)
plus `adapter/` written by `save_peft`."""

import json
import shutil

import numpy as np
import pytest

import hf_tiny
from helpers import decisive, rel_err
from lora_tiny import peft, torch

from anelm.cli.main import main
from anelm.models.adapters import LoraSpec, init_adapter
from anelm.models.formats.peft import save_peft
from anelm.models.loading import load_model

NLL_TOL = 1e-2  # as tests/cli/test_cli_perplexity.py: the emulator's fp16 logits, averaged over ~60 predictions
FP32_TOL = 1e-4  # a merged float32 model against PEFT's float32 base + adapter


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base folder, finetune RUN folder, text file, ids, PEFT model of base + the RUN's adapter)."""
    from anelm.train.checkpoint import Checkpoint, save_checkpoint

    root = tmp_path_factory.mktemp("lora-cli")
    base = root / "base"
    hf_tiny.make_word_model(base, seed=5)
    config, weights, _ = load_model(base)
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(base / name, run / name)
    save_checkpoint(run, Checkpoint(step=4, config=config.to_dict(), weights=weights))
    adapter = init_adapter(config, LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj", "up_proj"), str(base)), seed=3)
    rng = np.random.default_rng(4)
    for k, (a, b) in adapter.tensors.items():
        adapter.tensors[k] = (a, (0.3 * rng.standard_normal(b.shape)).astype(np.float32))
    save_peft(adapter, run / "adapter")
    ids = np.random.default_rng(8).integers(3, 96, 64).tolist()
    text = root / "text.txt"
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    pm = peft.PeftModel.from_pretrained(fresh_hf(base), run / "adapter").eval()
    return base, run, text, ids, pm


def fresh_hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def error_of(capsys, argv, code=1):
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anelm: error: "), err
    return err[0]


def test_perplexity_with_an_adapter_is_peft_s(world, capsys):
    base, run, text, ids, pm = world
    argv = ["perplexity", "--model", str(base), "--data", str(text), "--seq-len", "32", "--json", "--device", "emulator"]
    assert main(argv + ["--adapter", str(run)]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    ref_nll, rows = hf_tiny.hf_windows(pm, ids, 32)
    assert abs(res["nll"] - ref_nll) <= NLL_TOL and "adapter:" in err and "LoRA rank 4" in err
    ref = np.concatenate(rows)
    firm = [i for i, row in enumerate(ref) if decisive(row)]
    assert len(firm) >= 20 and [res["argmax"][i] for i in firm] == [int(ref[i].argmax()) for i in firm]
    assert main(argv) == 0  # the base alone chooses differently: the adapter was applied
    plain = json.loads(capsys.readouterr().out)["argmax"]
    assert sum(plain[i] != res["argmax"][i] for i in firm) >= len(firm) // 4


def test_generate_and_chat_take_an_adapter(world, capsys, monkeypatch):
    import io

    base, run, _, _, pm = world
    assert main(["generate", "--model", str(base), "--adapter", str(run / "adapter"), "--prompt", "w5 w9 w22",
                 "--max-tokens", "6", "--temperature", "0", "--json", "--device", "emulator"]) == 0
    res = json.loads(capsys.readouterr().out)
    ref = hf_tiny.hf_logits(pm, res["prompt_ids"] + res["ids"])[len(res["prompt_ids"]) - 1:-1]
    checked = [(t, row) for t, row in zip(res["ids"], ref) if decisive(row)]
    assert checked and all(t == int(row.argmax()) for t, row in checked)
    monkeypatch.setattr("sys.stdin", io.StringIO("w5 w9\n"))
    assert main(["chat", "--model", str(base), "--adapter", str(run), "--max-tokens", "3",
                 "--temperature", "0", "--device", "emulator"]) == 0
    assert "LoRA rank 4" in capsys.readouterr().err


def test_export_writes_the_peft_folder_and_the_merged_model(world, tmp_path, capsys):
    base, run, _, ids, pm = world
    assert main(["export", str(run), "--out", str(tmp_path / "adapter")]) == 0
    again = peft.PeftModel.from_pretrained(fresh_hf(base), tmp_path / "adapter").eval()
    want = hf_tiny.hf_logits(pm, ids)
    np.testing.assert_array_equal(hf_tiny.hf_logits(again, ids), want)
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = fresh_hf(tmp_path / "merged")
    assert rel_err(hf_tiny.hf_logits(merged, ids), want) < FP32_TOL
    assert rel_err(hf_tiny.hf_logits(fresh_hf(base), ids), want) > 0.05
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    capsys.readouterr()


def test_bad_adapters_and_exports_are_one_line(world, tmp_path, capsys):
    base, run, text, _, _ = world
    ppl = ["perplexity", "--model", str(base), "--data", str(text), "--device", "emulator", "--adapter"]
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    assert "peft_type 'IA3' is not LoRA" in error_of(capsys, ppl + [str(tmp_path / "ia3")])
    assert "no adapter_config.json" in error_of(capsys, ppl + [str(tmp_path)])
    other = tmp_path / "other"
    hf_tiny.make_hf("llama-mha", other)
    peft.get_peft_model(fresh_hf(other), peft.LoraConfig(r=2, target_modules=["v_proj"])).save_pretrained(other / "a")
    capsys.readouterr()  # HF's progress bars
    assert "an adapter for another base" in error_of(capsys, ppl + [str(other / "a")])
    plain = tmp_path / "plain"
    shutil.copytree(run, plain, ignore=shutil.ignore_patterns("adapter"))
    assert "expected a finetune RUN folder" in error_of(capsys, ["export", str(plain), "--out", str(tmp_path / "x"),
                                                                 "--merge"])
    moved = tmp_path / "moved"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = json.loads((moved / "adapter" / "adapter_config.json").read_text())
    (moved / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "/gone"}))
    assert "expected --base PATH" in error_of(capsys, ["export", str(moved), "--out", str(tmp_path / "y"), "--merge"])
    assert main(["export", str(moved), "--out", str(tmp_path / "y"), "--merge", "--base", str(base)]) == 0
