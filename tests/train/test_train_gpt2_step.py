"""The GPT-2 training step (the shared kernels on the emulator; LayerNorm, biases, tanh GELU,
learned positions and the tied head on the CPU) against PyTorch autograd through HF's
`GPT2LMHeadModel` (eval mode: no dropout), every parameter's gradient, both pipelines.
Tolerances (docs/testing.md): max|got − ref| / max|ref| ≤ 5e-2 and cosine ≥ 0.999 per tensor;
the loss 1e-2 relative (forward only).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from anelm.chip.profile import STRICT
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.models.config import config_from_dict
from anelm.models.gpt2 import sanitize
from anelm.train.steps.gpt2 import GPT2TrainStep

from helpers import GRAD_COSINE, GRAD_TOL, rel_err

transformers = pytest.importorskip("transformers")
S, B, V, SCALE = 16, 2, 64, 1024.0


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    yield
    base.reset_compile_count()


# learned positions: asking for RoPE on the device changes nothing (no rotary tables to take)
@pytest.mark.parametrize("pipeline,rope", [("dynamic", False), ("static", False), ("dynamic", True)],
                         ids=["dynamic", "static", "dynamic-rope-asked"])
def test_gpt2_loss_and_every_gradient_match_autograd(pipeline, rope):
    hf_cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if n.endswith("bias") else
                    torch.empty_like(p).uniform_(0.5, 1.5) if p.ndim == 1 else
                    torch.randn_like(p) * min(p.shape) ** -0.5)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S))
    loss = F.cross_entropy(model(torch.tensor(x)).logits.reshape(-1, V), torch.tensor(y).reshape(-1))
    loss.backward()
    cfg = config_from_dict(hf_cfg.to_dict())
    weights = sanitize({n: p.detach().numpy().copy() for n, p in model.named_parameters()}, cfg)
    ref = sanitize({n: p.grad.numpy().copy() for n, p in model.named_parameters()}, cfg)
    with GPT2TrainStep(cfg, weights, Emulator(STRICT.replace(compile_budget=10**9)), seq_len=S,
                       pipeline=pipeline, rope_on_device=rope) as step:
        assert not step.kernel_dims.rope
        got_loss, grads, stats = step.loss_and_grads(x, y, loss_scale=SCALE)
    assert abs(got_loss - loss.item()) / loss.item() <= 1e-2
    assert set(grads) == set(ref)
    for name, want in ref.items():
        got = grads[name] / SCALE
        cos = np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want))
        assert got.shape == want.shape and rel_err(got, want) <= GRAD_TOL and cos >= GRAD_COSINE, (
            name, rel_err(got, want), cos)
    assert stats["device_flops"] > 0 and stats["cpu_flops"] > 0
