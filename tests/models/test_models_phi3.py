"""Phi-3 (`anelm/models/phi3.py`) against HF transformers float32: the fused checkpoint split at
load and fused back, the partial rotation, LongRoPE's per-sequence factors (a generation passing
the original context follows HF's `generate`, which runs the whole sequence again there), the
window, HF's config spellings, and PEFT adapters on the fused modules, on the CPU reference
and on the emulator (tolerances of docs/testing.md)."""

import json

import numpy as np
import pytest
from hf_tiny import hf_logits, make_hf, torch, transformers
from helpers import rel_err

from anelm.chip.profile import STRICT
from anelm.cli.main import main
from anelm.device.emulator import Emulator
from anelm.generate.pipeline import build_runner
from anelm.models.adapters import merge_weights
from anelm.models.formats.peft import load_peft, save_peft
from anelm.models.config import config_from_dict
from anelm.models.loading import build_model, load_model
from anelm.models.phi3 import sanitize, unsanitize
from anelm.models.rope import rope_frequencies

peft = pytest.importorskip("peft")
NOBUDGET = STRICT.replace(compile_budget=10**9)


@pytest.fixture(scope="module", params=["phi3", "phi3-mini"])
def tiny(request, tmp_path_factory):
    """(kind, HF model, our config, weights) of hf_tiny's Phi-4-mini-like and Phi-3-mini-like models."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf(request.param, folder, seed=7)
    config, weights, _ = load_model(folder)
    return request.param, hf, config, weights


def test_cpu_reference_matches_hf_within_and_past_the_original_context(tiny):
    kind, hf, config, weights = tiny
    assert (config.partial_rotary_factor, config.window(0)) == ((0.75, None) if kind == "phi3" else (1.0, 8))
    model, ids = build_model(config, weights), np.random.default_rng(3).integers(3, 96, 60).tolist()
    for n in (10, 48, 49, 60):  # LongRoPE's short factors up to 48 positions, the long ones past
        assert rel_err(model.forward(ids[:n]), hf_logits(hf, ids[:n])) < 1e-4, n


def test_a_generation_passing_the_original_context_follows_hfs_generate(tiny):
    kind, hf, config, weights = tiny
    model, prompt = build_model(config, weights), np.random.default_rng(4).integers(3, 96, 40).tolist()
    cache, tokens, worst = model.new_cache(), [], 0.0
    logits = model.prefill(prompt, cache, last_only=True)[-1]
    for _ in range(16):  # positions 40..55: past 48 at the tenth step
        tokens.append(int(np.argmax(logits)))
        worst = max(worst, rel_err(logits, hf_logits(hf, prompt + tokens[:-1])[-1]))  # HF's pass of that prefix
        logits = model.decode(tokens[-1], cache)
    assert worst < 1e-4
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert out[0, len(prompt):].tolist() == tokens


def test_longrope_on_the_emulator_past_the_original_context(tiny):
    kind, hf, config, weights = tiny
    runner = build_runner(config, weights, Emulator(NOBUDGET), max_context=64)
    ids = np.random.default_rng(5).integers(3, 96, 60).tolist()
    for n in (12, 60):
        assert rel_err(runner.prefill(ids[:n], runner.new_cache()), hf_logits(hf, ids[:n])) <= 3e-2, n


def test_the_window_is_hf_eager_attentions(tmp_path):
    """HF 5.24's Phi-3 masks to `sliding_window` whatever the attention implementation, eager too."""
    make_hf("phi3-mini", tmp_path, seed=7)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    config, weights, _ = load_model(tmp_path)
    ids = np.random.default_rng(6).integers(3, 96, 40).tolist()  # 40 positions, a window of 8
    assert config.window(1) == 8 and rel_err(build_model(config, weights).forward(ids), hf_logits(eager, ids)) < 1e-4


def test_a_gguf_holds_the_same_model(tiny, tmp_path):
    """llama.cpp's layout (Phi3MiniModel): fused attn_qkv/ffn_up, the rotated dims, the window (0: none),
    LongRoPE's factor tensors; the tests of the phi3 family (test_generate_families) run the Phi-4-mini-like one."""
    import family_tiny

    kind, hf, config, weights = tiny
    c, w, _ = load_model(family_tiny.write_gguf(hf, tmp_path / "m.gguf", "phi3", "default"))
    assert (c.window(0), c.partial_rotary_factor, c.rope_scaling) == (config.window(0), config.partial_rotary_factor,
                                                                      config.rope_scaling)
    assert set(w) == set(weights) and all(np.array_equal(w[k], weights[k]) for k in w)


def test_sanitize_splits_and_unsanitize_fuses_back(tiny):
    _, hf, config, _ = tiny
    raw = {n: t.numpy() for n, t in hf.state_dict().items()}
    ours = sanitize(raw, config)
    assert "model.layers.0.self_attn.q_proj.weight" in ours and "model.layers.0.mlp.gate_up_proj.weight" not in ours
    back = unsanitize(ours, config)
    for n in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
        assert np.allclose(back[n], raw[n], rtol=1e-6, atol=0)
    assert sanitize(ours, config).keys() == ours.keys()  # a split checkpoint (a run's) passes as it is


def test_partial_rotation_frequencies_are_hfs_then_zero():
    hf = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.75)
    inv, _ = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    ours, gain = rope_frequencies(16, 10_000.0, {"rope_type": "default", "partial_rotary_factor": 0.75})
    assert ours.shape == (8,) and rel_err(ours[:6], inv.numpy()) <= 1.2e-7 and not ours[6:].any() and gain == 1.0


def test_hfs_config_spellings():
    base = {"model_type": "phi3", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 64, "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.5}
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    for kind in ("su", "yarn", "longrope"):  # HF's Phi-3 reads su and yarn as LongRoPE
        c = config_from_dict({**base, "rope_scaling": {"type": kind, **factors, "original_max_position_embeddings": 99}})
        assert c.rope_type == "longrope" and c.rope_scaling["original_max_position_embeddings"] == 16  # HF's priority
        assert c.rope_scaling["factor"] == 4.0 and c.attention_factor(0) == pytest.approx(np.sqrt(1 + np.log(4) / np.log(16)))
    assert c.partial_rotary_factor == 0.5 and c.at_length(16) is c and c.at_length(17).rope_scaling["short_factor"] == [2.0] * 4
    hf = transformers.Phi3Config(**{k: v for k, v in c.to_dict().items() if k not in ("model_type", "architectures")})
    assert config_from_dict(hf.to_dict()) == c


@pytest.mark.parametrize("rope, says", [({"type": "linear", "factor": 2.0}, "unsupported rope_type 'linear': expected "
                                         "one of default, longrope"),
                                        ({"type": "longrope", "short_factor": [1.0]}, "needs long_factor")])
def test_a_rope_phi3_does_not_run_is_one_line(tmp_path, capsys, rope, says):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", "vocab_size": 96, "hidden_size": 64,
                                                      "intermediate_size": 128, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "rope_scaling": rope}))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("anelm: error: ") and says in err, err


def test_a_peft_adapter_on_the_fused_modules_loads_runs_merges_and_saves(tiny, tmp_path):
    kind, _, config, weights = tiny
    hf = make_hf(kind, tmp_path / "base", seed=7)  # PEFT wraps the model it is given: a fresh one
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj",
                                                                                      "down_proj"])).eval()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path / "peft")
    adapter = load_peft(tmp_path / "peft", config)
    assert adapter.spec.targets == ("qkv_proj", "gate_up_proj", "down_proj") and adapter.roles() == (
        "q", "k", "v", "gate", "up", "down")
    ids = np.random.default_rng(9).integers(3, 96, 30).tolist()
    ref = hf_logits(pm, ids)
    model = build_model(config, weights)
    model.set_adapter(adapter)
    assert rel_err(model.forward(ids), ref) < 1e-4
    assert rel_err(build_model(config, merge_weights(weights, adapter)).forward(ids), ref) < 1e-4
    runner = build_runner(config, weights, Emulator(NOBUDGET), max_context=64, adapter=adapter)
    assert rel_err(runner.prefill(ids, runner.new_cache()), ref) <= 3e-2
    again = load_peft(save_peft(adapter, tmp_path / "ours"), config)
    assert all(np.array_equal(a, b) for k in adapter.tensors for a, b in zip(adapter.tensors[k], again.tensors[k]))
