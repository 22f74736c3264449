"""RoPE scaling (`anelm.models.rope`): every rope type's frequencies and attention factor against
HF's own ROPE_INIT_FUNCTIONS, the config's completion of HF's parameters, tiny models of each
runnable type against HF float32 at positions past `original_max_position_embeddings`, and the
one-line refusal of a type anelm does not run."""

import json

import numpy as np
import pytest
from hf_tiny import LLAMA, hf_logits, randomize, torch, transformers
from helpers import rel_err

from anelm.cli.main import main
from anelm.models.config import config_from_dict
from anelm.models.loading import build_model, load_model
from anelm.models.rope import RUNNABLE, ROPE_TYPES, llama3_from_divisors, rope_frequencies

HEAD_DIM, CONTEXT = 64, 2048
LONG = {"short_factor": np.linspace(1.0, 2.0, HEAD_DIM // 2).tolist(),
        "long_factor": np.linspace(1.0, 8.0, HEAD_DIM // 2).tolist()}
PARAMETERS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "attention_factor": 1.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "longrope", "original_max_position_embeddings": 512, **LONG},
    {"rope_type": "longrope", "original_max_position_embeddings": 512, "attention_factor": 1.2, **LONG},
]


def hf_config(rope: dict, theta: float, **kw):
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=CONTEXT, rope_parameters={**rope, "rope_theta": theta}, **kw)


@pytest.mark.parametrize("rope", PARAMETERS, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
@pytest.mark.parametrize("seq_len", [None, 100, 600, 4096])
def test_frequencies_and_attention_factor_equal_hf(rope, theta, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config(dict(rope), theta)
    inv, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu", seq_len=seq_len)
    params = {k: v for k, v in hf.rope_parameters.items() if k != "rope_theta"}
    ours, gain = rope_frequencies(HEAD_DIM, theta, params, seq_len, CONTEXT)
    assert ours.dtype == np.float32 and ours.shape == (HEAD_DIM // 2,)
    assert rel_err(ours, inv.numpy()) <= 1.2e-7  # float32 rounding: numpy's and torch's pow
    assert gain == pytest.approx(factor, rel=1e-12)


def test_plain_rope_equals_hf_default():
    hf = hf_config({"rope_type": "default"}, 10_000.0)
    inv, factor = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    ours, gain = rope_frequencies(HEAD_DIM, 10_000.0)
    assert rel_err(ours, inv.numpy()) <= 1.2e-7 and gain == factor == 1.0


def test_the_table_holds_every_hf_type_it_names():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_TYPES) - {"default", "none"} <= set(ROPE_INIT_FUNCTIONS)  # none: a NoPE layer's own
    assert set(RUNNABLE) == set(ROPE_TYPES) - {"longrope", "none"}  # longrope: only Phi-3 runs it (its own types)


def test_the_config_completes_parameters_as_hf_does():
    base = {"model_type": "llama", "max_position_embeddings": 4096, "rope_theta": 5e5}
    c = config_from_dict({**base, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0}})
    assert c.rope_scaling["original_max_position_embeddings"] == 4096 and c.rope_type == "llama3"
    y = config_from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": None,
                                                      "original_max_position_embeddings": 1024}})
    assert y.rope_scaling["factor"] == 4.0 and y.attention_factor(0) == pytest.approx(0.1 * np.log(4) + 1)
    assert config_from_dict({**base, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None


# --- tiny models of each type, on the CPU reference, past the original context ----------------------

SCALED = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", SCALED)
def test_tiny_models_match_hf_past_the_original_context(tmp_path, kind):
    config = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                      rope_parameters={**SCALED[kind], "rope_theta": 500.0}, **LLAMA)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    randomize(hf, seed=4)
    hf.save_pretrained(tmp_path)
    ours, weights, _ = load_model(tmp_path)
    assert ours.rope_type == SCALED[kind]["rope_type"]
    ids = np.random.default_rng(5).integers(0, 96, 60).tolist()  # to position 59: past 16, within 64
    assert rel_err(build_model(ours, weights).forward(ids), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("rope, named", [({"rope_type": "longrope", "original_max_position_embeddings": 16, **LONG},
                                          "'longrope'"), ({"type": "su", "factor": 2.0}, "'su'")])
def test_an_unsupported_rope_type_is_one_line_naming_the_supported(tmp_path, capsys, rope, named):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 96, "hidden_size": 64,
                                                      "intermediate_size": 128, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "rope_scaling": rope}))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("anelm: error: "), err
    assert f"unsupported rope_type {named}: expected one of {', '.join(RUNNABLE)}" in err


@pytest.mark.parametrize("theta, head_dim, factor, high, old", [
    (500_000.0, 128, 8.0, 4.0, 8192),   # Llama 3.1 8B
    (500_000.0, 64, 32.0, 4.0, 8192),   # Llama 3.2 1B
    (500.0, 16, 4.0, 4.0, 16),          # the tiny test model: two pairs in the blend
    (10_000.0, 64, 16.0, 2.0, 1024),
])
def test_llama3_parameters_come_back_from_llama_cpp_divisors(theta, head_dim, factor, high, old):
    from family_tiny import rope_divisors

    p = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
         "original_max_position_embeddings": old}
    assert llama3_from_divisors(rope_divisors({**p, "rope_theta": theta}, head_dim), head_dim, theta) == p


def test_divisors_that_are_not_llama3s_are_refused():
    assert llama3_from_divisors(np.ones(8, np.float32), 16, 500.0) is None  # no scaling at all
    assert llama3_from_divisors(np.linspace(1, 4, 8), 16, 500.0) is None  # no blend of Llama 3's shape
    assert llama3_from_divisors(np.ones(4, np.float32), 16, 500.0) is None  # another head size
