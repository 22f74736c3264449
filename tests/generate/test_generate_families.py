"""The families users download (docs/models.md), each a tiny random model built with transformers' own
config class and saved as an HF folder and as the GGUF llama.cpp's converter would write from it
(tests/family_tiny.py), against HF transformers float32 on the same weights:

- both load to the same config and weights, and to HF's logits on the CPU reference;
- on the emulator under `strict`, greedy generation follows HF's argmax (docs/testing.md's tie rule)
  and `anelm perplexity` agrees (ratio within 2 %, argmax agreement >= 97 %), from each;
- the texts pass what each family scales or windows: positions past YaRN's and Llama 3's
  `original_max_position_embeddings` (16) and LongRoPE's (48: a generation passing it is judged
  by HF's pass of each prefix, as HF's generation runs the sequence again there), past
  Mistral's window (8);
- `anelm quantize --scheme w8` runs on each.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import family_tiny
import hf_tiny
from helpers import rel_err

from anelm.chip.profile import STRICT
from anelm.cli.main import main
from anelm.device.emulator import Emulator
from anelm.generate.pipeline import build_runner
from anelm.models.loading import build_model, load_model

NOBUDGET = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test file
AGREEMENT, PPL_RATIO = 0.97, 0.02
SEQ = 64  # the models' context: every window passes the original context and the window
# family -> (hf_tiny kind, GGUF arch, pre-tokenizer, {arch}.* keys, q/k permuted, rope_freqs tensor)
FAMILIES = {
    "qwen2": ("qwen2", "qwen2", "qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                          "rope.scaling.original_context_length": 16}, False, False),
    "llama": ("llama3", "llama", "llama-bpe", {}, True, True),  # Llama 3.x: q/k permuted, rope_freqs
    "mistral": ("mistral", "llama", "default", {"attention.sliding_window": 8}, True, False),
    "smollm3": ("smollm3", "smollm3", "llama-bpe", {}, True, False),  # NoPE on layer 4 (llama.cpp's constant)
    # Phi-4-mini's shape: qkv and gate_up fused, 3/4 of each head rotated, LongRoPE past 48
    "phi3": ("phi3", "phi3", "default", {}, False, False),
}


@pytest.fixture(scope="module", params=FAMILIES)
def world(request, tmp_path_factory):
    """(family, HF model, {"folder": path, "gguf": path}, text file, its ids)."""
    kind, arch, pre, meta, permute, freqs = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = family_tiny.make(kind, root / "hf", seed=41)
    path = family_tiny.write_gguf(hf, root / f"{request.param}.gguf", arch, pre, meta, permute, freqs)
    ids = family_tiny.word_text(root / "text.txt", 3 * SEQ, seed=42)
    return request.param, hf, {"folder": root / "hf", "gguf": path}, root / "text.txt", ids


def test_folder_and_gguf_load_the_same_model(world):
    family, hf, paths, _, ids = world
    (c1, w1, tok1), (c2, w2, tok2) = load_model(paths["folder"]), load_model(paths["gguf"])
    assert c1.model_type == c2.model_type == family
    assert c1.rope_scaling == c2.rope_scaling and c1.tie_word_embeddings == c2.tie_word_embeddings
    assert [c1.window(i) for i in range(c1.num_hidden_layers)] == [c2.window(i) for i in range(c2.num_hidden_layers)]
    assert set(w1) == set(w2) and all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert tok2.chat_template == family_tiny.CHAT and (tok2.bos_id, tok2.eos_id) == (1, 2)
    ref = hf_tiny.hf_logits(hf, ids[:60])
    for config, weights in ((c1, w1), (c2, w2)):
        assert rel_err(build_model(config, weights).forward(ids[:60]), ref) < 1e-4


def test_export_of_the_gguf_is_hfs_model(world, tmp_path, capsys):
    _, hf, paths, _, ids = world
    assert main(["export", str(paths["gguf"]), "--out", str(tmp_path / "hf")]) == 0
    ours = hf_tiny.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=hf_tiny.torch.float32)
    assert type(ours).__name__ == type(hf).__name__
    assert rel_err(hf_tiny.hf_logits(ours.eval(), ids[:60]), hf_tiny.hf_logits(hf, ids[:60])) < 1e-5
    capsys.readouterr()


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_greedy_generation_on_the_emulator_follows_hf(world, source):
    _, hf, paths, _, ids = world
    config, weights, _ = load_model(paths[source])
    runner = build_runner(config, weights, Emulator(NOBUDGET), max_context=SEQ)
    # 12 prompt tokens, then to position 51: past the original context and the window
    tokens, judged, wrong = hf_tiny.greedy_against_hf(runner, hf, ids[:12], 40, config.rope_type == "longrope")
    assert not wrong, f"steps {wrong} of {tokens}"
    assert len(judged) >= 20, f"only {len(judged)} of 40 steps were decisive"


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_perplexity_agrees_with_hf(world, source, capsys):
    _, hf, paths, text, _ = world
    argv = ["perplexity", "--model", str(paths[source]), "--data", str(text), "--seq-len", str(SEQ),
            "--json", "--device", "emulator"]
    if source == "gguf":  # the GGUF's vocabulary has no merges: the folder's tokenizer reads the text
        argv += ["--tokenizer", str(paths["folder"])]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    ref_nll, rows = hf_tiny.hf_windows(hf, res["tokens"], SEQ)
    agree = float(np.mean(np.asarray(res["argmax"]) == np.concatenate(rows).argmax(axis=1)))
    ratio = res["ppl"] / np.exp(ref_nll)
    assert agree >= AGREEMENT, f"argmax agreement {agree:.4f}"
    assert abs(ratio - 1) <= PPL_RATIO, f"perplexity ratio {ratio:.5f}"


def test_quantize_w8_runs(world, tmp_path, capsys):
    _, _, paths, text, _ = world
    out = tmp_path / "w8"
    assert main(["quantize", "--model", str(paths["folder"]), "--out", str(out), "--scheme", "w8", "--data",
                 str(text), "--calib-tokens", "64", "--eval-tokens", "128", "--device", "emulator"]) == 0
    rep = json.loads((out / "quantization_report.json").read_text())
    # the sharpened head on random text: perplexities in the millions, so judged on the nll
    nll, qnll = np.log(rep["source_ppl"]), np.log(rep["quantized_ppl"])
    assert abs(qnll - nll) <= 0.02 * nll, (nll, qnll)
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "w5 w9 w12", "--max-tokens", "4",
                 "--temperature", "0", "--json", "--device", "emulator"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 4


@pytest.fixture(scope="module")
def qwen2_finetune(tmp_path_factory):
    """(base folder, finetune RUN folder, text, ids) of a 3-step LoRA finetune of the tiny Qwen2."""
    root = tmp_path_factory.mktemp("qwen2-lora")
    family_tiny.make("qwen2", root / "base", seed=43)
    ids = family_tiny.word_text(root / "text.txt", 400, seed=44)
    assert main(["finetune", "--model", str(root / "base"), "--data", str(root / "text.txt"), "--steps", "3",
                 "--seq-len", "32", "--targets", "all-linear", "--out", str(root / "run"), "--device", "emulator"]) == 0
    return root / "base", root / "run", root / "text.txt", ids


def test_qwen2_finetune_adapter_loads_in_peft_and_perplexity_agrees(qwen2_finetune, capsys):
    from lora_tiny import peft

    base, run, text, ids = qwen2_finetune
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    pm = peft.PeftModel.from_pretrained(hf_tiny.transformers.AutoModelForCausalLM.from_pretrained(base),
                                        run / "adapter").eval()
    plain = hf_tiny.transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    ref_nll = hf_tiny.hf_windows(pm, ids[:SEQ], SEQ)[0]
    assert abs(ref_nll - hf_tiny.hf_windows(plain, ids[:SEQ], SEQ)[0]) > 1e-3  # the adapter learned something
    capsys.readouterr()
    assert main(["perplexity", "--model", str(base), "--adapter", str(run), "--data", str(text),
                 "--max-tokens", str(SEQ), "--seq-len", str(SEQ), "--json", "--device", "emulator"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert abs(res["nll"] - ref_nll) <= 1e-2 * abs(ref_nll), (res["nll"], ref_nll)


@pytest.mark.parametrize("meta, divisors, says", [
    ({}, np.linspace(1.0, 4.0, 8, dtype=np.float32), "rope_freqs.weight holds no Llama 3 RoPE scaling"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, True, "both llama.rope.scaling keys and a rope_freqs"),
])
def test_a_rope_freqs_tensor_llama3_does_not_explain_is_one_line(tmp_path, capsys, meta, divisors, says):
    hf = family_tiny.make("llama3", tmp_path / "hf", seed=45)
    path = family_tiny.write_gguf(hf, tmp_path / "odd.gguf", "llama", "llama-bpe", meta, True, divisors)
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--device", "emulator"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("anelm: error: ") and says in err, err


def test_mistral_keeps_a_ring_of_its_window_on_every_layer(tmp_path):
    from anelm.models.config import config_from_dict

    hf = family_tiny.make("mistral", tmp_path / "hf", seed=46)
    config, weights, _ = load_model(tmp_path / "hf")
    assert [config.window(i) for i in range(2)] == [8, 8]
    runner = build_runner(config, weights, Emulator(NOBUDGET), max_context=SEQ)
    assert runner.rings == (16, 16)  # the window of 8 in a ring of 16 columns (strict's multiple)
    ids = np.random.default_rng(47).integers(3, 96, 50).tolist()
    assert rel_err(runner.prefill(ids, runner.new_cache()), hf_tiny.hf_logits(hf, ids)) <= 3e-2  # docs/testing.md
    v02 = config_from_dict({**config.to_dict(), "sliding_window": None})  # v0.2 on: every key
    assert v02.window(0) is None


def test_a_llama_gguf_without_a_window_is_llama_as_llama_cpp_runs_it(tmp_path):
    hf = family_tiny.make("mistral", tmp_path / "hf", seed=46)
    path = family_tiny.write_gguf(hf, tmp_path / "m.gguf", "llama", "default", {}, True)
    config, _, _ = load_model(path)
    assert config.model_type == "llama" and config.window(0) is None
