"""Configs: HF field names both ways (checked with transformers' own config classes), derived
defaults and one-line validation errors."""

import json

import pytest
from hf_tiny import transformers

from anelm.models.config import GPT2Config, LlamaConfig, Qwen3Config, config_from_dict
from anelm.models.errors import ConfigError


def test_from_dict_ignores_unknown_keys_and_derives_defaults():
    c = config_from_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                          "num_hidden_layers": 2, "intermediate_size": 96, "lr": 3e-4, "steps": 10})
    assert (c.num_key_value_heads, c.head_dim, c.model_type) == (4, 16, "llama")
    g = config_from_dict({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "foo": 1})
    got = (g.n_inner, g.hidden_size, g.head_dim, g.num_key_value_heads, g.max_position_embeddings)
    assert got == (256, 64, 16, 4, 1024)


@pytest.mark.parametrize("config", [
    LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, rope_theta=5e5, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 128}),
    Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6),
    GPT2Config(n_embd=64, n_head=4, n_layer=3, n_positions=128),
])
def test_to_dict_is_read_back_by_transformers_and_by_us(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__.lower().startswith(config.model_type)
    names = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
             "tie_word_embeddings"]  # GPT-2's HF config maps these to n_embd, n_layer...
    if config.model_type != "gpt2":
        names += ["num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps"]
    for name in names:
        assert getattr(hf, name) == getattr(config, name), name
    if config.model_type != "gpt2":
        assert hf.rope_parameters["rope_theta"] == config.rope_theta
        assert hf.rope_parameters["rope_type"] == config.rope_type
    assert config_from_dict(json.loads((tmp_path / "config.json").read_text())) == config


@pytest.mark.parametrize("d, message", [
    ({"model_type": "bert"}, r"unsupported model_type 'bert' in config: expected one of gemma3_text, gpt2, llama, mistral, phi3, qwen2, qwen3, smollm3"),
    ({"hidden_size": 8}, r"unsupported model_type None"),
    ({"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4},
     r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"),
    ({"model_type": "llama", "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 4},
     r"num_attention_heads \(6\) must be divisible by num_key_value_heads \(4\)"),
    ({"model_type": "llama", "hidden_size": 12, "num_attention_heads": 4}, r"head_dim must be even for RoPE, got 3"),
    ({"model_type": "llama", "num_hidden_layers": 0}, r"num_hidden_layers must be a positive integer, got 0"),
    ({"model_type": "llama", "vocab_size": "32000"}, r"vocab_size must be a positive integer, got '32000'"),
    ({"model_type": "llama", "hidden_act": "gelu"}, r"hidden_act must be 'silu', got 'gelu'"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "su", "factor": 4}}, r"unsupported rope_type 'su'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 4}},
     r"rope_type 'llama3' needs low_freq_factor"),
    ({"model_type": "qwen3", "use_sliding_window": True}, r"use_sliding_window is not supported"),
    ({"model_type": "gpt2", "activation_function": "relu"}, r"activation_function must be the tanh GELU"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 5}, r"n_embd \(64\) must be divisible by n_head \(5\)"),
])
def test_bad_configs_are_one_line_errors(d, message):
    with pytest.raises(ConfigError, match=message) as e:
        config_from_dict(d)
    assert "\n" not in str(e.value)


def test_v4_style_rope_theta_is_read():
    c = config_from_dict({"model_type": "llama", "rope_theta": 123.0, "rope_scaling": None})
    assert (c.rope_theta, c.rope_scaling) == (123.0, None)

