"""The trainer loop against an independent PyTorch training loop, and its failure modes.

The device step is replaced by `TorchStep`, a stand-in with the same API whose loss and
gradients come from HF `LlamaForCausalLM` autograd in float32. That isolates what this file
tests (accumulation, loss scaling, unscale, clipping, weight decay groups, the schedule,
AdamW, metrics, checkpoints) from the device's fp16 numerics, and lets a test inject an
overflow or a NaN loss at a chosen step. The oracle is a plain torch loop: the same batches,
`torch.nn.utils.clip_grad_norm_`, `torch.optim.AdamW` with a no-decay group for the norms.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

from anelm.device.base import compile_count
from anelm.train.data.corpus import write_corpus
from anelm.train import loop
from anelm.train.data import Batcher, unigram_entropy
from anelm.train.errors import TrainError
from anelm.train.loop import Trainer
from anelm.train.report import sample_text, summary
from anelm.train.metrics import read_metrics
from anelm.train.run import prepare

torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention


class TorchStep:
    """DeviceTrainStep's API over HF autograd. `inject` maps a 1-based call number to
    "inf_grad" or "nan_loss"."""

    compiles_per_update = 0

    def __init__(self, config, weights, device, *, seq_len, pipeline="dynamic", inject=None):
        d = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        self.model = LlamaForCausalLM(HFLlamaConfig(**d, attn_implementation="eager")).float()
        self.inject, self.calls, self.seq_len = dict(inject or {}), 0, seq_len
        self.set_weights(weights)

    def set_weights(self, weights):
        sd = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
        self.model.load_state_dict(sd, strict=False)  # tied: lm_head is the embedding

    def _loss(self, x, y):
        logits = self.model(torch.from_numpy(np.asarray(x))).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(np.asarray(y)).reshape(-1))

    def loss_and_grads(self, x, y, loss_scale=1.0):
        self.calls += 1
        self.model.zero_grad()
        loss = self._loss(x, y)
        (loss * loss_scale).backward()
        grads = {n: p.grad.numpy().copy() for n, p in self.model.named_parameters()}
        what = self.inject.get(self.calls)
        if what == "inf_grad":
            grads["model.layers.0.mlp.up_proj.weight"][0, 0] = np.inf
        value = float("nan") if what == "nan_loss" else float(loss.detach())
        stats = {"device_flops": 10, "cpu_flops": 5, "t_device": 0.0, "t_cpu": 0.0, "t_dw": 0.0}
        return value, grads, stats

    def loss(self, x, y, positions=None):  # plain text: every row's positions from 0
        assert positions is None
        with torch.no_grad():
            return float(self._loss(x, y))

    def close(self):
        pass


@pytest.fixture
def data_file(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    return write_corpus(tmp_path_factory.getbasetemp() / "stories.txt", n_bytes=30_000, seed=3)


def make_setup(tmp_path, data_file, **over):
    explicit = dict(preset="tiny", data=str(data_file), steps=6, batch_size=2, seq_len=16, lr=3e-3,
                    bpe_vocab_size=300, eval_batches=2, sample_tokens=8)
    explicit.update(over)
    return prepare(explicit, tmp_path / "run", resume=False)


def train(setup, inject=None, **kw):
    factory = lambda *a, **k: TorchStep(*a, **k, inject=inject)  # noqa: E731
    t = Trainer(setup, device="stand-in", step_factory=factory, progress=False, **kw)
    try:
        return t, t.train()
    finally:
        t.close()


def reference_lr(step, peak, total, warmup):
    """The run's learning-rate schedule written out: linear warmup from peak/W, cosine to 10 % at the end."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup - 1, 1)
    return 0.1 * peak + 0.5 * 0.9 * peak * (1 + math.cos(math.pi * min(progress, 1.0)))


def torch_reference(setup, steps, accum, clip, wd):
    """The same run as a textbook torch loop."""
    a = setup.args
    ref = TorchStep(setup.model_config, init_params(setup), None, seq_len=a.seq_len).model
    params = dict(ref.named_parameters())
    decay = [p for n, p in params.items() if p.ndim >= 2]
    rest = [p for n, p in params.items() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    batcher, losses, norms = Batcher(setup.data.train, a.batch_size, a.seq_len, a.seed), [], []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = reference_lr(step, a.lr, a.steps, a.warmup)
        total = 0.0
        for _ in range(accum):
            x, y = batcher.next()
            logits = ref(torch.from_numpy(x)).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
            (loss / accum).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total / accum)
    return {n: p.detach().numpy() for n, p in params.items()}, losses, norms


def init_params(setup):
    from anelm.train.init import init_weights

    return init_weights(setup.model_config, setup.args.seed)


def test_updates_match_a_torch_training_loop(tmp_path, data_file):
    # accumulation over 2 micro-batches, a clip that bites (norms are ~1-3), weight decay, a
    # fixed loss scale of 1024 (exact in binary, so unscaling is exact): weights and losses
    # must match torch's loop to float32 round-off over 5 steps.
    setup = make_setup(tmp_path, data_file, steps=5, grad_accum=2, clip=0.5, weight_decay=0.1,
                       loss_scale="1024", warmup=2)
    t, out = train(setup)
    want, losses, norms = torch_reference(setup, 5, accum=2, clip=0.5, wd=0.1)
    for name, w in want.items():
        got = t.params[name]
        assert np.abs(got - w).max() <= 1e-5 * np.abs(w).max(), name
    recs = [r for r in read_metrics(setup.run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in recs], losses, rtol=1e-5)
    np.testing.assert_allclose([r["lr"] for r in recs],
                               [reference_lr(s, 3e-3, 5, 2) for s in range(5)], rtol=1e-12)
    # the norm before clipping: the mean over micro-batches (Adam alone would hide a wrong scale)
    np.testing.assert_allclose([r["grad_norm"] for r in recs], norms, rtol=1e-5)
    assert min(norms) > 0.5  # the clip was active
    assert all(r["loss_scale"] == 1024.0 and r["skipped"] is False for r in recs)


def test_metrics_eval_checkpoints_and_plot(tmp_path, data_file, monkeypatch):
    setup = make_setup(tmp_path, data_file, steps=10, keep_last=2)
    drawn, draw = [], loop.plot_loss
    monkeypatch.setattr(loop, "plot_loss", lambda run, reference: drawn.append(reference) or draw(run, reference))
    _, out = train(setup)
    recs = read_metrics(setup.run)
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    need = {"step", "loss", "lr", "loss_scale", "tokens_per_s", "device", "device_flops", "cpu_flops",
            "compiles"}
    assert all(need <= set(r) for r in steps) and len(steps) == 10
    assert all(r["compiles"] == compile_count() for r in steps)  # the process's count (docs/fine-tuning.md)
    # the loop adds AdamW's 14 flops per parameter to the step's own CPU count
    n = sum(p.size for p in setup.params.values())
    assert steps[0]["cpu_flops"] == 5 + 14 * n and steps[0]["device_flops"] == 10
    assert [r["step"] for r in evals] == list(range(1, 11))  # 10 % of 10 steps = every step
    assert all("loss" not in r for r in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns
    assert out.final_eval_loss == evals[-1]["eval_loss"]
    ckpts = sorted(p.name for p in (setup.run / "checkpoints").iterdir())
    assert ckpts == ["step-000009.safetensors", "step-000010.safetensors"]  # keep_last=2
    assert (setup.run / "loss.png").stat().st_size > 1000
    assert drawn and all(r == pytest.approx(unigram_entropy(setup.data.tokens)) for r in drawn)
    assert "unigram entropy" in summary(setup, out)
    cfg = json.loads((setup.run / "config.json").read_text())
    assert cfg["anelm_train"]["steps"] == 10 and cfg["architectures"] == ["LlamaForCausalLM"]
    text = sample_text(setup, 8, seed=0)
    assert isinstance(text, str)


def test_overflow_skips_the_update_halves_the_scale_and_recovers(tmp_path, data_file):
    setup = make_setup(tmp_path, data_file, steps=5)
    snap = {}

    class Spy(TorchStep):
        def set_weights(self, weights):
            snap[self.calls] = {k: v.copy() for k, v in weights.items()}
            super().set_weights(weights)

    t = Trainer(setup, "stand-in", step_factory=lambda *a, **k: Spy(*a, **k, inject={3: "inf_grad"}),
                progress=False)
    t.train()
    recs = [r for r in read_metrics(setup.run) if "loss" in r]
    assert [r["skipped"] for r in recs] == [False, False, True, False, False]
    assert recs[2]["loss_scale"] == 4096.0 and recs[3]["loss_scale"] == 2048.0
    assert 3 not in snap  # no weight update was sent to the device for the skipped step
    assert t.opt.t == 4 and t.step == 5  # AdamW stepped 4 times; the run still did 5 steps
    assert all(np.isfinite(p).all() for p in t.params.values())


def test_non_finite_forward_loss_stops_with_the_last_checkpoint_intact(tmp_path, data_file):
    setup = make_setup(tmp_path, data_file, steps=8, save_every=2)
    with pytest.raises(TrainError) as e:
        train(setup, inject={5: "nan_loss"})
    msg = str(e.value)
    assert "\n" not in msg and "non-finite training loss" in msg and "step 5" in msg
    assert "step-000004.safetensors" in msg
    names = sorted(p.name for p in (setup.run / "checkpoints").iterdir())
    assert names[-1] == "step-000004.safetensors"
    from anelm.train.checkpoint import load_checkpoint

    assert load_checkpoint(setup.run / "checkpoints" / names[-1]).step == 4
    assert max(r["step"] for r in read_metrics(setup.run)) == 4


def test_resume_in_process_continues_exactly(tmp_path, data_file):
    # stop after 4 of 8 steps (as a kill after the step-4 checkpoint would), resume, compare
    straight = make_setup(tmp_path / "a", data_file, steps=8, save_every=4, loss_scale="dynamic")
    train(straight)
    first = make_setup(tmp_path / "b", data_file, steps=8, save_every=4)
    t = Trainer(first, "stand-in", step_factory=TorchStep, progress=False)
    t.a = t.a.__class__(**{**t.a.to_dict(), "steps": 4})  # stop early, as if killed
    t.train()
    t.close()
    resumed = prepare({"steps": None}, tmp_path / "b" / "run", resume=True)
    assert resumed.checkpoint.step == 4
    train(resumed)
    loss = lambda s: {r["step"]: r["loss"] for r in read_metrics(s.run) if "loss" in r}  # noqa: E731
    assert loss(straight) == loss(resumed)  # bit-identical on the same machine


def test_resume_before_the_first_checkpoint_starts_over_identically(tmp_path, data_file):
    # a run killed before its first checkpoint leaves config.json and tokenizer.json only
    straight = make_setup(tmp_path / "a", data_file, steps=3)
    train(straight)
    died = make_setup(tmp_path / "b", data_file, steps=3)
    (died.run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n{"step": 2, "lo')  # torn
    again = prepare({}, died.run, resume=True)
    assert again.checkpoint is None
    assert all(np.array_equal(again.params[k], died.params[k]) for k in died.params)
    train(again)
    loss = lambda s: {r["step"]: r["loss"] for r in read_metrics(s.run) if "loss" in r}  # noqa: E731
    assert loss(again) == loss(straight)


def test_without_a_bar_a_progress_line_comes_at_least_every_progress_every_s(tmp_path, data_file, monkeypatch,
                                                                            capsys):
    """Without a terminal the only lines were the evals' (10 % of the steps), so a long
    run could be silent for hours; a step line now comes whenever PROGRESS_EVERY_S (0 here) passed."""
    monkeypatch.setattr(loop, "PROGRESS_EVERY_S", 0.0)
    setup = make_setup(tmp_path, data_file, steps=4, eval_every=4)
    train(setup)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("anelm: step ")]
    heads = [line.split(",")[0].split(": eval")[0] for line in lines]
    assert heads[:4] == ["anelm: step 1/4", "anelm: step 2/4", "anelm: step 3/4", "anelm: step 4/4"]
    assert ": eval loss " in lines[3]  # the eval's line is one of them
    assert all("train loss" in line and "tok/s" in line and "ETA" in line for line in lines)
