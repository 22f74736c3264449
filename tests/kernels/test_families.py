"""The architecture families (`anelm/kernels/families/`) agree with the model definitions they
describe: every role they name is a real HF weight of each member's layers, their LoRA slots
cover exactly the projections PEFT may target, and the training kernels' weight blocks are the
model's matrices (GPT-2's q, k, v: the row thirds of c_attn). Exact checks: no arithmetic."""

import numpy as np
import pytest

from anelm.kernels.families import FAMILIES, GEMMA, GPT2, LLAMA, family_for
from anelm.kernels.training import ROLES, Dims, kernel_roles
from anelm.models import registry
from anelm.models.config import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen3Config
from anelm.models.names import FAMILY, PROJECTIONS, layer_prefix, random_layer

CONFIGS = {"gpt2": GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=64),
           "llama": LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8),
           "qwen3": Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16),
           "gemma3_text": Gemma3TextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=64),
           "qwen2": registry.module("qwen2").Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2),
           "mistral": registry.module("mistral").Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
           "smollm3": registry.module("smollm3").Config(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                                        num_attention_heads=4, num_key_value_heads=2),
           "phi3": registry.module("phi3").Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)}


def test_every_model_type_has_its_family():
    assert set(CONFIGS) == set(FAMILY)
    assert family_for("gpt2") is GPT2 and family_for("llama") is LLAMA and family_for("qwen3") is LLAMA
    assert family_for("gemma3_text") is GEMMA and family_for("qwen2") is LLAMA and family_for("mistral") is LLAMA
    assert family_for("phi3") is LLAMA  # its fused q/k/v and gate/up are split as it loads
    assert set(FAMILIES) == set(FAMILY.values())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_roles_name_the_weights_of_each_member(model_type):
    cfg, f = CONFIGS[model_type], family_for(model_type)
    w = random_layer(cfg)
    raw = f.linears(w, cfg.hidden_size)
    assert set(raw) == {"q", "k", "v"} | (set(f.slot_roles) - {"qkv"})
    for key, (mat, bias) in raw.items():  # GPT-2's q, k, v come from c_attn: their own rows
        assert mat.ndim == 2 and (bias is None or bias.shape == (mat.shape[0],)), key
    for norm in ("attn_norm", "mlp_norm", *f.post_norms):
        gain, shift = f.affine(w, norm)
        assert gain.shape == (cfg.hidden_size,) and (shift is not None) == f.layer_norm
        # the gain as applied: Gemma stores w and applies 1 + w
        np.testing.assert_array_equal(gain, w[f.modules[norm] + ".weight"] + np.float32(f.gain_offset))
    assert f.head_norms(w) == (model_type in ("qwen3", "gemma3_text"))
    # the LoRA slots hold every projection PEFT may target, each once
    held = [r for roles in f.slot_roles.values() for r in roles]
    assert sorted(held) == sorted(PROJECTIONS[model_type])
    assert all(f.reads_norm(k) is not None for k in ("qkv", *f.mlp_inputs))
    assert all(f.reads_norm(k) is None for k in f.stream_writers)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_training_weight_blocks_are_the_model_matrices(model_type):
    cfg, f = CONFIGS[model_type], family_for(model_type)
    weights = {layer_prefix(model_type, 1) + k: v for k, v in random_layer(cfg, seed=1).items()}
    m = Dims.from_config(cfg, 16)
    assert m.gated == f.gated
    roles = {r for kind in ROLES for r in kernel_roles(kind, m)}
    assert roles == {r for rs in f.part_roles.values() for r in rs}
    for part, kroles in f.part_roles.items():
        full = weights[f"{layer_prefix(model_type, 1)}{f.modules[part]}.weight"]
        np.testing.assert_array_equal(np.concatenate([f.layer_matrix(weights, 1, r) for r in kroles]), full)
    if model_type == "gpt2":
        d = cfg.hidden_size
        assert [f.layer_matrix(weights, 1, r).shape for r in ("wq", "wk", "wv")] == [(d, d)] * 3
