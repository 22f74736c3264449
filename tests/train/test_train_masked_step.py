"""Loss masks and packed sequences in the device training step, against PyTorch autograd.

A batch of instruction data holds several examples per sequence (packing), each at positions
from 0 and attending only inside itself, and counts only some targets (the answers). The
oracle runs HF's float32 model (eager attention) on each example alone, sums the cross-entropy
of its counted targets, and divides by the count over all examples: the step on the packed
batch must give that loss and every gradient (PEFT's adapter gradients for LoRA). Llama with
GQA, Qwen3, GPT-2 (learned positions: the restart at 0 reaches the position table), Gemma 3
(a sliding window shorter than an example: the window is on positions) and Qwen2 (q, k, v
biases and their gradients, YaRN), Mistral (a window on every layer) and SmolLM3 (layers without
RoPE, windowed) cover what the mask and the positions touch. Tolerances as docs/testing.md:
gradients max|got − ref| / max|ref| ≤ 5e-2 and cosine ≥ 0.999, the loss 1e-2 relative.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hf_tiny
import lora_tiny
from anelm.chip.profile import STRICT
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.errors import ShapeError
from anelm.models.adapters import LoraSpec
from anelm.models import registry
from anelm.models.config import config_from_dict
from anelm.train.steps.cpu_ops import IGNORE
from anelm.train.steps import lora_train_step
from anelm.train.steps import step_class

S, SCALE = 24, 1024.0
PROFILE = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test
# two sequences of S: examples of 10 + 8 predictions and padding, then 13 + 11 (no padding)
LAYOUT = [[11, 9], [14, 12]]


@pytest.fixture(autouse=True, scope="module")
def _compile_count_as_found():
    yield
    base.reset_compile_count()


def examples(vocab: int, seed: int = 3):
    """Token lists and their counted masks (counted[j]: token j is a scored target), the first
    token never counted, a prompt of a few tokens not counted, one example counting all."""
    rng = np.random.default_rng(seed)
    out = []
    for row in LAYOUT:
        for n in row:
            ids = rng.integers(3, vocab, n)
            counted = np.zeros(n, bool)
            counted[1 if len(out) == 2 else n // 3:] = True
            out.append((ids, counted))
    return out


def packed_batch(exs):
    """x, y (IGNORE where not counted and in padding), positions: examples in LAYOUT's rows."""
    x = np.zeros((len(LAYOUT), S), np.int64)
    y = np.full((len(LAYOUT), S), IGNORE, np.int64)
    pos = np.zeros((len(LAYOUT), S), np.int64)
    it = iter(exs)
    for r, row in enumerate(LAYOUT):
        col = 0
        for n in row:
            ids, counted = next(it)
            k = n - 1  # predictions
            x[r, col:col + k] = ids[:-1]
            y[r, col:col + k] = np.where(counted[1:], ids[1:], IGNORE)
            pos[r, col:col + k] = np.arange(k)
            col += k
        pos[r, col:] = np.arange(S - col)  # padding: a segment of its own
    return x, y, pos


def hf_reference(model, exs):
    """HF's loss (counted targets' cross-entropy summed over every example alone, over their
    count) and its gradients, by parameter name."""
    model.zero_grad()
    total = sum(int(c[1:].sum()) for _, c in exs)
    loss = 0
    for ids, counted in exs:
        logits = model(torch.tensor(ids[None, :-1])).logits[0]
        target = torch.tensor(np.where(counted[1:], ids[1:], IGNORE))
        loss = loss + F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")
    loss = loss / total
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(loss, grads, ref_loss, ref_grads, rename=lambda n: n):
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (loss, ref_loss)
    for name, ref in ref_grads.items():
        got = grads[rename(name)].astype(np.float64) / SCALE
        ref = ref.astype(np.float64)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        cos = float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref))
        assert err <= 5e-2 and cos >= 0.999, f"{name}: err {err:.3g}, cos {cos:.6f}"


def tiny(kind, tmp_path):
    """(HF model, our config, its weights as anelm names them: the registry's sanitize)."""
    hf = hf_tiny.make_hf(kind, tmp_path, seed=5).float()
    config = config_from_dict(hf.config.to_dict(), "test")
    arch = registry.module(config.model_type)
    weights = {n: t.detach().numpy().copy() for n, t in hf.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return hf, config, arch.sanitize(weights, config), arch


def ours(arch, config, grads):
    """HF's gradients by anelm's names and layout (GPT-2's Conv1D)."""
    return arch.sanitize(grads, config)


# "+rope": RoPE inside the attention kernels, on each example's own positions
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3-untied", "gpt2", "gemma3", "qwen2", "mistral",
                                  "smollm3-window", "llama-gqa+rope", "gemma3+rope"])
def test_packed_masked_loss_and_gradients_match_each_example_alone(kind, tmp_path):
    kind, rope = kind.removesuffix("+rope"), kind.endswith("+rope")
    hf, config, weights, arch = tiny(kind, tmp_path)
    hf.config._attn_implementation = "eager"
    exs = examples(config.vocab_size)
    ref_loss, ref_grads = hf_reference(hf, exs)
    ref_grads = ours(arch, config, ref_grads)
    x, y, pos = packed_batch(exs)
    with step_class(config)(config, weights, Emulator(PROFILE), seq_len=S, packed=True, rope_on_device=rope) as step:
        assert step.kernel_dims.rope == rope
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=SCALE, positions=pos)
        eval_loss = step.loss(x, y, positions=pos)
    tied = config.tie_word_embeddings
    assert_close(loss, grads, ref_loss, {n: g for n, g in ref_grads.items() if not (tied and n == "lm_head.weight")})
    assert abs(eval_loss - loss) <= 1e-4 * abs(loss)


@pytest.mark.parametrize("rope", [False, True], ids=["rope-on-cpu", "rope-on-device"])
def test_lora_packed_masked_gradients_match_peft(rope, tmp_path):
    hf, config, weights, _ = tiny("llama-gqa", tmp_path)
    pm = lora_tiny.make_peft(hf, "llama-gqa", rank=4, alpha=8.0)
    pm.base_model.model.config._attn_implementation = "eager"
    exs = examples(config.vocab_size, seed=4)
    ref_loss, ref_grads = hf_reference(pm, exs)
    adapter = {}
    for path, (a, b) in lora_tiny.peft_tensors(pm).items():
        adapter[path + ".lora_A.weight"], adapter[path + ".lora_B.weight"] = a, b
    spec = LoraSpec(4, 8.0, 0.0, tuple(lora_tiny.TARGETS["llama-gqa"]))
    x, y, pos = packed_batch(exs)
    step = lora_train_step(config, weights, Emulator(PROFILE), seq_len=S, spec=spec, adapter=adapter, packed=True,
                           rope_on_device=rope)
    with step:
        loss, grads, _ = step.loss_and_grads(x, y, loss_scale=SCALE, positions=pos)
    ref = {n.removeprefix("base_model.model.").replace(".default", ""): g for n, g in ref_grads.items()}
    assert set(grads) == set(ref)
    assert_close(loss, grads, ref_loss, ref)


def test_count_sets_the_denominator_and_ignored_targets_add_nothing(tmp_path):
    """Two micro-batches given the step's count add up to the loss and gradients of both at once
    (what gradient accumulation and the all-reduce rely on)."""
    _, config, weights, _ = tiny("llama-gqa", tmp_path)
    x, y, pos = packed_batch(examples(config.vocab_size))
    total = int((y != IGNORE).sum())
    with step_class(config)(config, weights, Emulator(PROFILE), seq_len=S, packed=True) as step:
        both, g_both, _ = step.loss_and_grads(x, y, SCALE, positions=pos)
        parts = [step.loss_and_grads(x[i:i + 1], y[i:i + 1], SCALE, positions=pos[i:i + 1], count=total)
                 for i in range(2)]
        with pytest.raises(ShapeError, match="positions"):
            step.loss_and_grads(x, y, positions=pos[:, :5])
    assert abs(sum(p[0] for p in parts) - both) <= 1e-5 * both
    # float32 sums in another order (a norm's gradient sums terms of both signs over every
    # token): measured ≤ 2.3e-4 of the largest; a per-micro-batch mean would be off by ~2x
    for name, g in g_both.items():
        err = np.abs(parts[0][1][name] + parts[1][1][name] - g).max() / np.abs(g).max()
        assert err <= 1e-3, (name, err)


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_two_examples_packed_give_each_ones_loss_alone(kind, tmp_path):
    """One sequence holding examples A and B: counting only A's targets gives A's loss alone (A in
    a sequence of its own, padded), and only B's gives B's, though B sits at columns 10.. after A.
    fp16 on the device, the same arithmetic per example: 1e-4 relative."""
    _, config, weights, _ = tiny(kind, tmp_path)
    (a, ca), (b, cb), *_ = examples(config.vocab_size)
    x, y, pos = packed_batch([(a, ca), (b, cb)] + examples(config.vocab_size)[2:])
    x, y, pos = x[:1], y[:1], pos[:1]  # the row of A (10 predictions) and B (8), then padding
    with step_class(config)(config, weights, Emulator(PROFILE), seq_len=S, packed=True) as step:
        for lo, hi, ids, counted in ((0, 10, a, ca), (10, 18, b, cb)):
            only = np.full_like(y, IGNORE)
            only[:, lo:hi] = y[:, lo:hi]
            alone_x, alone_y = np.zeros_like(x), np.full_like(y, IGNORE)
            alone_x[0, :len(ids) - 1] = ids[:-1]
            alone_y[0, :len(ids) - 1] = np.where(counted[1:], ids[1:], IGNORE)
            packed = step.loss(x, only, positions=pos)
            alone = step.loss(alone_x, alone_y, positions=np.arange(S)[None])
            assert abs(packed - alone) <= 1e-4 * alone, (packed, alone)
