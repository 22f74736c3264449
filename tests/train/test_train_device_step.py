"""The device training step (kernels on the emulator + CPU ops) against PyTorch autograd.

For each architecture (MHA tied, GQA untied, Qwen3 with q/k norm and head_dim ≠ hidden/heads)
and both pipelines, the loss and every parameter gradient of one step must match the float32
HF model (eager attention) on the same weights and batch. Tolerances (docs/testing.md):
gradients max|got − ref| / max|ref| ≤ 5e-2 and cosine ≥ 0.999 each (measured: ≤ 3.5e-3 and
≥ 0.999994); the loss 1e-2 relative, stricter because it passes through the forward only
(measured ≤ 1e-4). Weights are drawn at trained-model scale (not HF's 0.02 init) and norm
weights away from 1, so every gradient is exercised.
"""

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaConfig as HFLlamaConfig, LlamaForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config as HFQwen3Config, Qwen3ForCausalLM

from anelm.device import base
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.errors import ShapeError, UsageError
from anelm.models.config import LlamaConfig, Qwen3Config
from anelm.kernels.training import WEIGHTED
from anelm.train.scaler import grads_finite
from anelm.train.steps.llama import DeviceTrainStep

V, D, FF, L, S, B = 64, 32, 64, 2, 16, 2
SCALE = 1024.0
PROFILE = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    """These tests compile many programs (uncapped profile), but the count is process-wide:
    later tests that use the strict budget start from zero, as a fresh process would."""
    yield
    base.reset_compile_count()


ARCHS = {  # name: (model_type, heads, kv heads, head_dim, tied)
    "mha-tied": ("llama", 4, 4, 8, True),
    "gqa-untied": ("llama", 4, 2, 8, False),
    "qwen3": ("qwen3", 4, 2, 12, True),
}


def hf_kwargs(arch):
    kind, heads, kv, hd, tied = ARCHS[arch]
    return kind, dict(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
                      max_position_embeddings=64)


@functools.lru_cache(maxsize=None)
def reference(arch):
    """(our config, weights, x, y, HF loss, HF grads) for one architecture."""
    kind, kw = hf_kwargs(arch)
    torch.manual_seed(0)
    hf_cls, model_cls = (HFQwen3Config, Qwen3ForCausalLM) if kind == "qwen3" else (HFLlamaConfig, LlamaForCausalLM)
    model = model_cls(hf_cls(**kw, attn_implementation="eager")).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
            elif "embed" in n:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S))
    loss = F.cross_entropy(model(torch.tensor(x)).logits.reshape(-1, V), torch.tensor(y).reshape(-1))
    loss.backward()
    weights = {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}
    if kw["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)  # HF's state dict lists the tied head too
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    cfg = (Qwen3Config if kind == "qwen3" else LlamaConfig).from_dict(kw)
    return cfg, weights, x, y, loss.item(), grads


def make_step(arch, pipeline, profile=PROFILE, weights=None, rope_on_device=False):
    cfg, w, *_ = reference(arch)
    return DeviceTrainStep(cfg, weights or w, Emulator(profile), seq_len=S, pipeline=pipeline,
                           rope_on_device=rope_on_device)


# RoPE and its inverse on the CPU, or inside the attention kernels (`rope_on_device`, the ANE's
# default): the same tolerances; the dynamic pipeline for the latter (the attention kernels
# carry no weights, so both pipelines run them alike)
@pytest.mark.parametrize("pipeline,rope_on_device", [("dynamic", False), ("static", False), ("dynamic", True)],
                         ids=["dynamic", "static", "dynamic-rope-on-device"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_loss_and_every_gradient_match_autograd(arch, pipeline, rope_on_device):
    _, _, x, y, ref_loss, ref_grads = reference(arch)
    step = make_step(arch, pipeline, rope_on_device=rope_on_device)
    assert step.kernel_dims.rope == rope_on_device
    try:
        loss, grads, stats = step.loss_and_grads(x, y, loss_scale=SCALE)
    finally:
        step.close()
    assert abs(loss - ref_loss) / ref_loss <= 1e-2
    assert set(grads) == set(ref_grads)
    for name, want in ref_grads.items():
        got = grads[name] / SCALE
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        cos = np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want))
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert err <= 5e-2 and cos >= 0.999, (name, err, cos)
    assert stats["device_flops"] > 0 and stats["cpu_flops"] > 0
    assert all(stats[k] >= 0 for k in ("t_device", "t_cpu", "t_dw"))


@pytest.mark.parametrize("arch", ["gqa-untied", "qwen3"])
def test_carrying_the_probabilities_changes_no_result(arch, monkeypatch):
    """sdpa_bwd given the forward's probabilities (`carry_probs`, the default at these sizes),
    left on the device (the default where they fit) or kept on the host, against it recomputing
    them: the same loss and gradients, bit for bit, over B sequences, two micro-batches each (so
    both slots of every layer and sequence)."""
    from anelm.train.steps import attention

    cfg, w, x, y, *_ = reference(arch)
    got = {}
    for mode in ("device", "host", "recompute"):
        monkeypatch.setattr(attention, "resident_fits", attention.resident_fits if mode == "device" else
                            lambda *a: False)
        with DeviceTrainStep(cfg, w, Emulator(PROFILE), seq_len=S, carry_probs=mode != "recompute") as step:
            assert step.kernel_dims.carry_probs == (mode != "recompute")
            got[mode] = [step.loss_and_grads(x[::-1], y[::-1], loss_scale=SCALE)[0],
                         *step.loss_and_grads(x, y, loss_scale=SCALE)[:2]]
            kept = sorted(step.bank._probs)
            batch, layers = x.shape[0], cfg.num_hidden_layers
            assert kept == ([(i, (p, b)) for i in range(layers) for p in (0, 1) for b in range(batch)]
                            if mode == "device" else []), kept
    for mode in ("device", "host"):
        assert got[mode][:2] == got["recompute"][:2], mode
        for name, g in got["recompute"][2].items():
            assert np.array_equal(got[mode][2][name], g), (mode, name)


def test_probabilities_left_on_the_device_are_not_read_back(monkeypatch):
    """With the probabilities on the device, sdpa_fwd's results on the host are the attention
    output alone and sdpa_bwd is given no probabilities: they never cross."""
    from anelm.train.steps.kernels_bank import KernelBank

    cfg, w, x, y, *_ = reference("gqa-untied")
    seen = []
    run = KernelBank.run

    def spy(self, kind, layer, acts, slot=None):
        out = run(self, kind, layer, acts, slot)
        if kind in ("sdpa_fwd", "sdpa_bwd"):
            seen.append((kind, slot is not None, sorted(acts), sorted(out)))
        return out

    monkeypatch.setattr(KernelBank, "run", spy)
    with DeviceTrainStep(cfg, w, Emulator(PROFILE), seq_len=S) as step:
        step.loss_and_grads(x, y, loss_scale=SCALE)
    assert seen and all(resident for _, resident, _, _ in seen)
    assert all("probs" not in acts and "probs" not in out for _, _, acts, out in seen)


def perturbed(arch):
    rng = np.random.default_rng(5)
    return {n: (w + 0.05 * rng.standard_normal(w.shape)).astype(np.float32)
            for n, w in reference(arch)[1].items()}


@pytest.mark.parametrize("pipeline,profile,per_update", [
    ("static", STRICT, len(WEIGHTED) * L),                                # recompile every program
    ("static", STRICT.replace(reload_reads_new_weights=True), 0),         # rewrite blobs + reload
    ("dynamic", STRICT, 0),                                                # restage the inputs
])
def test_weight_update_costs_compiles_per_update(fresh_compile_count, cold_compiles, pipeline, profile, per_update):
    _, _, x, y, *_ = reference("gqa-untied")
    new = perturbed("gqa-untied")
    step = make_step("gqa-untied", pipeline, profile)
    fresh = make_step("gqa-untied", pipeline, profile, weights=new)
    try:
        before = step.loss(x, y)
        assert step.compiles_per_update == per_update
        n = compile_count()
        step.set_weights(new)
        assert compile_count() - n == per_update
        # the device now computes with the new weights: same numbers as a step built with them
        assert step.loss(x, y) == fresh.loss(x, y) != before
        got, want = step.loss_and_grads(x, y, SCALE)[1], fresh.loss_and_grads(x, y, SCALE)[1]
        assert all(np.array_equal(got[n], want[n]) for n in want)
    finally:
        step.close()
        fresh.close()


def test_overflowing_loss_scale_returns_non_finite_grads():
    _, _, x, y, ref_loss, _ = reference("mha-tied")
    step = make_step("mha-tied", "dynamic")
    try:
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=SCALE)
        assert grads_finite(grads)
        # dlogits × 1e8 exceed fp16's 65504 on the way into the device: inf, then NaN
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=1e8)
    finally:
        step.close()
    assert abs(loss - ref_loss) / ref_loss <= 1e-2  # the loss itself is unscaled and fine
    assert not grads_finite(grads)
    assert set(grads) == set(reference("mha-tied")[1])


def test_bad_arguments_are_one_line_errors():
    cfg, w, x, y, *_ = reference("mha-tied")
    with pytest.raises(UsageError, match="unknown pipeline 'jit'"):
        DeviceTrainStep(cfg, w, Emulator(PROFILE), seq_len=S, pipeline="jit")
    bad = {n: a for n, a in w.items() if n != "model.norm.weight"}
    with pytest.raises(ShapeError, match="missing \\['model.norm.weight'\\]"):
        DeviceTrainStep(cfg, bad, Emulator(PROFILE), seq_len=S)
    step = make_step("mha-tied", "dynamic")
    try:
        with pytest.raises(ShapeError, match=f"expected token ids x and targets y of shape \\[B, {S}\\]"):
            step.loss(x[:, :-1], y[:, :-1])
    finally:
        step.close()


def test_on_the_ane_rope_and_the_swiglu_backward_run_in_the_kernels_by_default():
    """Where the device is the ANE, the attention kernels rotate q and k and ffn_down_dx runs the
    SwiGLU backward (`Dims.rope`, `Dims.swiglu_dx`); on the emulator both stay on the CPU."""
    cfg, w, *_ = reference("gqa-untied")
    ane = Emulator(PROFILE)
    ane.name = "ane"  # the emulator standing in for the chip: the defaults follow the device's name
    for device, on in ((ane, True), (Emulator(PROFILE), False)):
        with DeviceTrainStep(cfg, w, device, seq_len=S) as step:
            assert (step.kernel_dims.rope, step.kernel_dims.swiglu_dx) == (on, on)
