"""Gradient accumulation inside the dW GEMMs (`loss_and_grads(into=, add=)`, `train/steps/gemm.py`).

The trainer hands the step its accumulator: the first micro-batch writes every gradient into
it, later ones add, each dW by the sgemm's β rather than a pass of its own. Two micro-batches
so accumulated must equal the two steps' own gradients summed (float32 round-off: the GEMM
adds its partial sums into the buffer), for a tied and an untied head, a LoRA step (whose
adapter gradients are added after their products) and the chunked classifier; and with the
first micro-batch's products left running beside the second's forward (`defer`).
"""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.device.emulator import Emulator
from anelm.models.config import LlamaConfig
from anelm.train.steps import cpu_ops as ops
from anelm.train.steps.gemm import dw_into
from anelm.train.init import init_weights
from anelm.train.steps.llama import DeviceTrainStep

S, B = 16, 2


def config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                       max_position_embeddings=64, tie_word_embeddings=tied)


def close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for n in want:
        err = np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)
        assert err < 1e-5, (n, err)


@pytest.mark.parametrize("tied", [True, False])
def test_two_micro_batches_into_the_accumulator_equal_their_sum(tied):
    cfg = config(tied)
    w = init_weights(cfg, seed=0)
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, 64, (B, S)), rng.integers(0, 64, (B, S))) for _ in range(2)]
    with DeviceTrainStep(cfg, w, Emulator(STRICT), seq_len=S) as step:
        alone = [step.loss_and_grads(x, y, 64.0)[1] for x, y in batches]
        want = {n: alone[0][n] + alone[1][n] for n in alone[0]}
        acc = {n: np.full_like(p, np.nan) for n, p in w.items()}  # stale contents must not leak in
        for k, (x, y) in enumerate(batches):
            loss, got, _ = step.loss_and_grads(x, y, 64.0, into=acc, add=k > 0)
        assert all(got[n] is acc[n] for n in got)
        close(got, want)
        # the first micro-batch's dW left running beside the second's forward (`defer`)
        acc = {n: np.full_like(p, np.nan) for n, p in w.items()}
        for k, (x, y) in enumerate(batches):
            loss, got, _ = step.loss_and_grads(x, y, 64.0, into=acc, add=k > 0, defer=k == 0)
        assert not step._deferred
        close(got, want)


def test_dw_into_writes_and_adds_with_views():
    rng = np.random.default_rng(0)
    dy, x = rng.standard_normal((48, 40), dtype=np.float32), rng.standard_normal((24, 40), dtype=np.float32)
    out = np.full((48, 24), np.nan, np.float32)
    dw_into(out, dy[:, 5:30], x[:, 5:30], add=False)  # column views: strided rows, no copy needed
    np.testing.assert_allclose(out, dy[:, 5:30] @ x[:, 5:30].T, rtol=1e-5, atol=1e-5)
    dw_into(out, dy, x, add=True)
    np.testing.assert_allclose(out, dy[:, 5:30] @ x[:, 5:30].T + dy @ x.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        dw_into(np.zeros((24, 48), np.float32), dy, x, add=False)


def test_chunked_head_accumulates_into_its_buffer(monkeypatch):
    rng = np.random.default_rng(1)
    head, xf = rng.standard_normal((50, 8), dtype=np.float32), rng.standard_normal((8, 12), dtype=np.float32)
    t = rng.integers(0, 50, 12)
    _, _, whole = ops.head_loss(head, xf, t, 8.0)
    monkeypatch.setattr(ops, "HEAD_CHUNK", 50 * 5)  # chunks of 5 positions
    buf = np.ones_like(head)
    _, _, call = ops.head_loss(head, xf, t, 8.0, out=buf, add=True)
    np.testing.assert_allclose(call(), 1.0 + whole(), rtol=1e-5, atol=1e-5)
    _, _, call = ops.head_loss(head, xf, t, 8.0, out=buf, add=False)
    np.testing.assert_allclose(call(), whole(), rtol=1e-5, atol=1e-5)


def test_lora_step_accumulates_its_adapter_gradients():
    from anelm.models.adapters import LoraSpec, init_adapter
    from anelm.train.steps.lora import adapter_params
    from anelm.train.steps import lora_train_step

    cfg = config(True)
    spec = LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj"))
    adapter = adapter_params(init_adapter(cfg, spec, seed=1))
    adapter = {n: a + 0.1 for n, a in adapter.items()}  # B nonzero: both gradients exercised
    rng = np.random.default_rng(3)
    batches = [(rng.integers(0, 64, (B, S)), rng.integers(0, 64, (B, S))) for _ in range(2)]
    with lora_train_step(cfg, init_weights(cfg, seed=0), Emulator(STRICT), seq_len=S, spec=spec,
                         adapter=adapter) as step:
        alone = [step.loss_and_grads(x, y, 64.0)[1] for x, y in batches]
        acc = {n: np.full_like(a, np.nan) for n, a in adapter.items()}
        for k, (x, y) in enumerate(batches):
            got = step.loss_and_grads(x, y, 64.0, into=acc, add=k > 0)[1]
        close(got, {n: alone[0][n] + alone[1][n] for n in alone[0]})
