"""The SwiGLU backward on the device (`Dims.swiglu_dx`: ffn_down_dx returns dh1, dh3).

Off on the emulator by default (its fp16 passes on the host are slower than the CPU's own), on
where the device is the ANE; here it is switched on to compare the two: every gradient of a
step with it within docs/testing.md's gradient tolerance of the CPU SwiGLU's (5e-2, cosine ≥
0.999), for Llama and Qwen3 shapes, both pipelines and a LoRA step on the MLP.
"""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.device.emulator import Emulator
from anelm.models.config import LlamaConfig, Qwen3Config
from anelm.train.init import init_weights
from anelm.train.steps.llama import DeviceTrainStep

PROFILE = STRICT.replace(compile_budget=10**9)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def cos(a, b):
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def config(kind):
    cls = Qwen3Config if kind == "qwen3" else LlamaConfig
    return cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64,
               tie_word_embeddings=True)


def grads(step_cls, cfg, w, on, **kw):
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (2, 16))
    with step_cls(cfg, w, Emulator(PROFILE), seq_len=16, swiglu_on_device=on, **kw) as step:
        assert step.kernel_dims.swiglu_dx == on
        return step.loss_and_grads(x, y, 256.0)[:2]


@pytest.mark.parametrize("kind, pipeline", [("llama", "dynamic"), ("qwen3", "dynamic"), ("llama", "static")])
def test_swiglu_backward_on_the_device_matches_the_cpus(kind, pipeline):
    cfg = config(kind)
    w = {n: p * (3.0 if p.ndim == 2 else 1.0) for n, p in init_weights(cfg, seed=0).items()}  # gates past 0
    (l0, g0), (l1, g1) = (grads(DeviceTrainStep, cfg, w, on, pipeline=pipeline) for on in (False, True))
    assert abs(l1 - l0) / l0 < 1e-3
    for n, g in g0.items():
        assert rel(g1[n], g) < 5e-2 and cos(g1[n], g) > 0.999, n


def test_lora_on_the_mlp_with_the_swiglu_backward_on_the_device():
    from anelm.models.adapters import LoraSpec, init_adapter
    from anelm.train.steps.lora import LoraTrainStep, adapter_params

    cfg = config("llama")
    spec = LoraSpec(4, 8.0, 0.1, ("down_proj", "up_proj"))
    adapter = {n: a + 0.1 for n, a in adapter_params(init_adapter(cfg, spec, seed=1)).items()}
    w = init_weights(cfg, seed=0)
    (l0, g0), (l1, g1) = (grads(LoraTrainStep, cfg, w, on, spec=spec, adapter=adapter) for on in (False, True))
    assert abs(l1 - l0) / l0 < 1e-3
    for n, g in g0.items():
        assert rel(g1[n], g) < 5e-2 and cos(g1[n], g) > 0.999, n
