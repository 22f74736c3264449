"""A sequence length that is not a multiple of 16 under `strict` (I/O widths in multiples of 16,
the spatial multiple of docs/chip-profiles.md): the training kernels run 16 columns, the last
ones zeros, and the step's loss and gradients are still those of the 12 real positions.

Oracles: PyTorch autograd on the float32 HF model with the same weights and a 12-token batch
(the tolerances of test_train_device_step: loss 1e-2 relative, each gradient max|got − ref| /
max|ref| ≤ 5e-2 and cosine ≥ 0.999); and, for the attention kernels alone, the real columns
bit for bit whatever the padding columns hold: causal attention keeps later (padding)
positions out of every real query, and zero dattn rows add nothing to real keys' gradients.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

from anelm.chip.profile import STRICT
from anelm.compiler.pipeline import compile_graph
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.kernels.training import Dims, build_graph, layouts
from anelm.models.config import LlamaConfig
from anelm.runtime.kernel import Kernel
from anelm.train.steps.llama import DeviceTrainStep

V, D, FF, L, S, B = 64, 32, 64, 2, 12, 2
SCALE = 1024.0
PROFILE = STRICT.replace(compile_budget=10**9)


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    yield
    base.reset_compile_count()


def _reference():
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(HFLlamaConfig(**kw, attn_implementation="eager")).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.3 if "embed" in n else p.shape[1] ** -0.5)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S))
    loss = F.cross_entropy(model(torch.tensor(x)).logits.reshape(-1, V), torch.tensor(y).reshape(-1))
    loss.backward()
    weights = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return LlamaConfig.from_dict(kw), weights, x, y, loss.item(), grads


@pytest.mark.parametrize("pipeline", ["dynamic", "static"])
def test_a_12_token_sequence_trains_on_16_column_kernels(pipeline):
    cfg, w, x, y, ref_loss, ref_grads = _reference()
    step = DeviceTrainStep(cfg, w, Emulator(PROFILE), seq_len=S, pipeline=pipeline)
    try:
        assert step.kernel_dims.s == 16 and step.dims.s == S
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=SCALE)
    finally:
        step.close()
    assert abs(loss - ref_loss) / ref_loss <= 1e-2
    for name, want in ref_grads.items():
        got = grads[name] / SCALE
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        cos = np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want))
        assert err <= 5e-2 and cos >= 0.999, (name, err, cos)


@pytest.mark.parametrize("kind", ["sdpa_fwd", "sdpa_bwd"])
def test_padding_columns_cannot_reach_the_real_positions(kind):
    m = Dims(d=D, f=FF, hq=4, hkv=2, hd=8, s=16)
    dev = Emulator(PROFILE)
    kernel = Kernel(compile_graph(build_graph(kind, m), PROFILE), dev, float32_outputs=True)
    rng = np.random.default_rng(3)
    real = {n: rng.standard_normal((1, pk.channels, 1, 16)).astype(np.float32)
            for n, pk in layouts(m)[kind].items()}
    for a in real.values():
        a[..., S:] = 0.0
    garbage = {n: a.copy() for n, a in real.items()}
    for n, a in garbage.items():
        if n != "da":  # the gradient flowing in is zero at padding positions: no loss there
            a[..., S:] = 4.0 * rng.standard_normal(a[..., S:].shape)
    clean = {n: a.copy() for n, a in kernel.run(real).items()}
    dirty = kernel.run(garbage)
    for name in clean:
        assert np.array_equal(clean[name][..., :S], dirty[name][..., :S]), name
    kernel.close()
