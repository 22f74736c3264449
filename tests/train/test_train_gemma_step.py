"""The Gemma 3 training step (kernels on the emulator + CPU ops) against PyTorch autograd.

One step's loss and every parameter gradient against HF's `Gemma3ForCausalLM` in float32
(eager attention) on the same weights and batch: post-norms and 1 + w gains, per-head q/k
norms, a sliding window shorter than the sequence on the local layers (their own kernels),
local and global RoPE bases, `query_pre_attn_scalar`, the gated GELU, the √hidden embedding
scale and the tied head. A vocabulary past the classifier's chunk (`cpu_ops.HEAD_CHUNK`,
lowered here) runs the chunked loss. Tolerances as docs/testing.md: gradients max|got − ref| /
max|ref| ≤ 5e-2 and cosine ≥ 0.999 each, the loss within 1e-2 relative.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig as HFGemma3TextConfig

from anelm.chip.profile import STRICT
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.models.config import config_from_dict
from anelm.train.steps import cpu_ops
from anelm.train.steps import step_class

V, D, FF, L, S, B = 64, 32, 64, 3, 24, 2
WINDOW = 7
SCALE = 1024.0
PROFILE = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    yield
    base.reset_compile_count()


@pytest.fixture(scope="module")
def reference():
    """(our config, weights, x, y, HF loss, HF grads)."""
    torch.manual_seed(0)
    hf_cfg = HFGemma3TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, sliding_window=WINDOW, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 30.0}},
        max_position_embeddings=64, attn_implementation="eager")
    model = Gemma3ForCausalLM(hf_cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(-0.5, 0.5)  # gains 1 + w in [0.5, 1.5]
            elif "embed" in n:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S))
    loss = F.cross_entropy(model(torch.tensor(x)).logits.reshape(-1, V), torch.tensor(y).reshape(-1))
    loss.backward()
    weights = {n: t.detach().numpy().copy() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    config = config_from_dict(hf_cfg.to_dict(), "test")
    return config, weights, x, y, loss.item(), grads


# RoPE on the CPU, or inside the attention kernels (the ANE's default), local and global bases alike
@pytest.mark.parametrize("pipeline,rope_on_device", [("dynamic", False), ("static", False), ("dynamic", True)],
                         ids=["dynamic", "static", "dynamic-rope-on-device"])
def test_loss_and_every_gradient_match_pytorch(reference, pipeline, rope_on_device, monkeypatch):
    config, weights, x, y, ref_loss, ref_grads = reference
    assert [config.window(i) for i in range(L)] == [WINDOW, None, WINDOW]
    monkeypatch.setattr(cpu_ops, "HEAD_CHUNK", V * 5)  # 5 positions a chunk: the chunked loss
    cls = step_class(config)
    with cls(config, weights, Emulator(PROFILE), seq_len=S, pipeline=pipeline, rope_on_device=rope_on_device) as step:
        assert step.kernel_dims.rope == rope_on_device
        loss, grads, stats = step.loss_and_grads(x, y, loss_scale=SCALE)
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (loss, ref_loss)
    assert set(grads) == set(weights)
    for name, ref in ref_grads.items():
        got = grads[name].astype(np.float64) / SCALE
        ref = ref.astype(np.float64)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        cos = float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref))
        assert err <= 5e-2 and cos >= 0.999, f"{name}: err {err:.3g}, cos {cos:.6f}"
    assert stats["device_flops"] > 0 and stats["cpu_flops"] > 0
