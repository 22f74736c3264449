"""`anelm finetune` on a tiny Qwen2 (biases on q, k and v; YaRN scaling past 16 positions) writes a
PEFT adapter that PEFT loads onto HF's Qwen2ForCausalLM with our logits (the CPU reference with
the adapter, float32 against float32: 1e-4), and the adapter moved them."""

import json

import pytest

import family_tiny
import hf_tiny
from helpers import rel_err

from anelm.cli.main import main
from anelm.models.formats.peft import load_peft
from anelm.models.loading import build_model, load_model

peft = pytest.importorskip("peft")


def test_finetune_on_qwen2_writes_an_adapter_peft_loads_with_our_logits(tmp_path, capsys):
    hf = family_tiny.make("qwen2", tmp_path / "base", seed=61)
    ids = family_tiny.word_text(tmp_path / "text.txt", 300, seed=62)
    assert main(["finetune", "--model", str(tmp_path / "base"), "--data", str(tmp_path / "text.txt"), "--steps", "2",
                 "--seq-len", "32", "--targets", "q_proj,k_proj,v_proj,o_proj", "--out", str(tmp_path / "run"),
                 "--device", "emulator"]) == 0
    capsys.readouterr()
    folder = tmp_path / "run" / "adapter"
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    pm = peft.PeftModel.from_pretrained(hf, folder).eval()
    config, weights, _ = load_model(tmp_path / "base")
    model = build_model(config, weights)
    model.set_adapter(load_peft(folder, config))
    for n in (12, 60):  # within and past YaRN's original context of 16
        assert rel_err(model.forward(ids[:n]), hf_tiny.hf_logits(pm, ids[:n])) < 1e-4
    with pm.disable_adapter():
        plain = hf_tiny.hf_logits(pm, ids[:60])
    assert rel_err(hf_tiny.hf_logits(pm, ids[:60]), plain) > 1e-4  # the adapter learned something
