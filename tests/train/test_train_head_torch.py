"""The classifier with its loss, and the embedding, on a torch device (`--head-on gpu`,
`--embed-on gpu`; train/steps/head_torch.py).

Here `ANELM_GPU=cpu` makes "gpu" torch's CPU device: the same code path a Mac's `mps` runs
(tensors staged to the device, products there, results copied back). The torch head computes
what `cpu_ops.head_loss` computes in float32, so the two agree to float32 round-off (1e-5
relative; measured 1e-6), chunked or not. A whole step with the head and the embedding on the
torch device gives the CPU step's loss and gradients to round-off; `anelm train --head-on gpu`
on the tiny model logs the all-device path's (`--head-on ane`) losses within the training
tolerance of test_train_head_device.py (2 %: the ANE's tiles compute the logits in fp16), and
resumes exactly. Without a GPU, `--head-on gpu` is one line.
"""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from anelm.chip.catalog import get_chip  # noqa: E402
from anelm.chip.profile import STRICT  # noqa: E402
from anelm.cli.main import main  # noqa: E402
from anelm.device.emulator import Emulator  # noqa: E402
from anelm.errors import UsageError  # noqa: E402
from anelm.models.config import LlamaConfig  # noqa: E402
from anelm.train.steps import cpu_ops as ops  # noqa: E402
from anelm.train.steps import head_torch  # noqa: E402
from anelm.train.init import init_weights  # noqa: E402
from anelm.train.metrics import read_metrics  # noqa: E402
from anelm.train.steps.placement import fastest_head, head_seconds  # noqa: E402
from anelm.train.steps.llama import DeviceTrainStep  # noqa: E402
from test_train_head_device import corpus, train  # noqa: E402,F401 - the same 20-step run and corpus

ROUND_OFF = 1e-5


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def gpu_is_cpu(monkeypatch):
    monkeypatch.setenv("ANELM_GPU", "cpu")


@pytest.mark.parametrize("chunk", [None, 1100 * 5])  # one pass; chunks of 5 positions (7 of them)
def test_torch_head_is_the_cpu_head(monkeypatch, chunk):
    if chunk:
        monkeypatch.setattr(head_torch, "HEAD_CHUNK", chunk)
    rng = np.random.default_rng(0)
    v, d, n = 1100, 32, 32
    w = (rng.standard_normal((v, d)) * 0.4).astype(np.float32)
    xf = rng.standard_normal((d, n)).astype(np.float32)
    t = rng.integers(0, v, n)
    t[[1, 7]] = ops.IGNORE
    head = head_torch.TorchHead("cpu")
    head.set_weights(w)
    loss, dx, dw = head.loss_and_grads(w, xf, t, 256.0, count=40)
    ref_loss, ref_dx, ref_dw = ops.head_loss(w, xf, t, 256.0, count=40)
    assert abs(loss - ref_loss) <= ROUND_OFF * ref_loss
    assert rel(dx, ref_dx) <= ROUND_OFF and rel(dw(), ref_dw()) <= ROUND_OFF
    assert np.all(dx[:, [1, 7]] == 0)
    buf = np.ones_like(w)  # gradient accumulation: dW added into the step's buffer
    _, _, call = head.loss_and_grads(w, xf, t, 256.0, count=40, out=buf, add=True)
    assert call() is buf and rel(buf - 1.0, ref_dw()) <= ROUND_OFF
    head.set_weights(w * 2)  # what the device holds is what was staged last
    assert abs(head.loss_and_grads(w, xf, t)[0] - ops.head_loss(w * 2, xf, t)[0]) <= ROUND_OFF * 10


def test_torch_embedding_is_the_cpu_embedding():
    rng = np.random.default_rng(2)
    table = rng.standard_normal((50, 8)).astype(np.float32)
    ids = np.array([3, 7, 3, 49, 0, 7, 7])
    emb = head_torch.TorchEmbedding("cpu")
    emb.set_weights(table)
    np.testing.assert_array_equal(emb.forward(ids), ops.embed_fwd(table, ids))
    dy = rng.standard_normal((8, ids.size)).astype(np.float32)
    want = ops.embed_bwd(dy, ids, np.full_like(table, 0.5))
    np.testing.assert_allclose(emb.backward(dy, ids, np.full_like(table, 0.5)), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_step_with_the_ends_on_the_torch_device_is_the_cpu_step(gpu_is_cpu, tied):
    cfg = LlamaConfig(vocab_size=700, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    w = init_weights(cfg, seed=0)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 700, (2, 16)), rng.integers(0, 700, (2, 16))
    y[0, :5] = ops.IGNORE
    out = {}
    for head_on, embed_on in (("cpu", "cpu"), ("gpu", "gpu"), ("gpu", "cpu")):
        with DeviceTrainStep(cfg, w, Emulator(STRICT), seq_len=16, head_on=head_on, embed_on=embed_on) as step:
            out[head_on, embed_on] = step.loss_and_grads(x, y, 1024.0)[:2]
            step.set_weights({n: p * 1.01 for n, p in w.items()})  # restaged: the next loss sees them
            out[head_on, embed_on, 2] = step.loss(x, y)
    ref_loss, ref = out["cpu", "cpu"]
    for key in (("gpu", "gpu"), ("gpu", "cpu")):
        loss, grads = out[key]
        assert abs(loss - ref_loss) <= ROUND_OFF * ref_loss and grads.keys() == ref.keys()
        assert abs(out[(*key, 2)] - out["cpu", "cpu", 2]) <= ROUND_OFF * out["cpu", "cpu", 2]
        for n, g in ref.items():  # the head and final norm: float32 sums in another order; what
            # the layers' backward reaches (the embedding too): dy's round-off can flip an fp16
            # rounding in the device's backward kernels (1 ulp: 1e-3)
            assert rel(grads[n], g) <= (1e-4 if n in ("lm_head.weight", "model.norm.weight") else 5e-3), (key, n)


@pytest.mark.parametrize("packed", [False, True])
def test_the_next_forward_beside_the_gpu_head_changes_nothing(gpu_is_cpu, packed):
    """`loss_and_grads(ahead=)`: the next micro-batch's forward runs while the head runs, and
    the next call starts from it. Weights do not change within a step, so the losses and the
    accumulated gradients are those of the calls one after another, bit for bit."""
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    w = init_weights(cfg, seed=3)
    rng = np.random.default_rng(5)
    batches = [(rng.integers(0, 300, (2, 16)), rng.integers(0, 300, (2, 16))) for _ in range(3)]
    pos = [np.tile(np.r_[np.arange(6), np.arange(10)], (2, 1)) if packed else None for _ in batches]
    runs = {}
    for ahead in (False, True):
        with DeviceTrainStep(cfg, w, Emulator(STRICT), seq_len=16, head_on="gpu", packed=packed) as step:
            assert step.head_runs_ahead
            forwards, plain = [], step._forward
            step._forward = lambda ids, keep: (forwards.append(ids.shape), plain(ids, keep))[1]
            acc = {n: np.zeros_like(p) for n, p in w.items()}
            losses, seen = [], []
            for k, (x, y) in enumerate(batches):
                nxt = (*batches[k + 1], pos[k + 1]) if ahead and k + 1 < len(batches) else None
                losses.append(step.loss_and_grads(x, y, 256.0, into=acc, add=k > 0, ahead=nxt,
                                                  **({"positions": pos[k]} if packed else {}))[0])
                seen.append(len(forwards))
            runs[ahead] = losses, acc, seen
    assert runs[True][0] == runs[False][0]
    assert runs[False][2] == [1, 2, 3] and runs[True][2] == [2, 3, 3]  # each next forward ran ahead, once
    for n, g in runs[False][1].items():
        assert np.array_equal(runs[True][1][n], g), n


def test_lora_step_with_the_head_on_the_torch_device(gpu_is_cpu):
    from anelm.models.adapters import LoraSpec, init_adapter
    from anelm.train.steps.lora import adapter_params
    from anelm.train.steps import lora_train_step

    cfg = LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=64)
    spec = LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj"))
    adapter = {n: a + 0.1 for n, a in adapter_params(init_adapter(cfg, spec, seed=1)).items()}
    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 600, (1, 16)), rng.integers(0, 600, (1, 16))
    out = {}
    for place in ("cpu", "gpu"):
        with lora_train_step(cfg, init_weights(cfg, seed=0), Emulator(STRICT), seq_len=16, spec=spec,
                             adapter=adapter, head_on=place, embed_on=place) as step:
            out[place] = step.loss_and_grads(x, y, 64.0)[:2]
    assert abs(out["gpu"][0] - out["cpu"][0]) <= ROUND_OFF * out["cpu"][0]
    for n, g in out["cpu"][1].items():
        assert rel(out["gpu"][1][n], g) <= 1e-4, n


def test_the_cost_model_prices_the_gpu_head_and_auto_takes_it_where_fastest():
    m4 = get_chip("m4")
    cpu, gpu = (head_seconds(p, 151936, 1024, 256, 1, m4, m4.cpu_exp_s) for p in ("cpu", "gpu"))
    assert gpu["gpu"] > 0 and gpu["gpu_beside"] > 0 and gpu["main"] < cpu["main"] / 100
    assert fastest_head(151936, 1024, 256, 1, 10, m4, m4.cpu_exp_s) == "gpu"
    assert fastest_head(151936, 1024, 256, 1, 10, m4, m4.cpu_exp_s, gpu=False) == "ane"
    m1 = get_chip("m1")  # no published GPU figures: never chosen, and asked for, one line
    assert fastest_head(151936, 1024, 256, 1, 10, m1, m1.cpu_exp_s) in ("ane", "cpu")
    with pytest.raises(UsageError, match="no published GPU figures"):
        head_seconds("gpu", 32000, 768, 256, 1, m1, m1.cpu_exp_s)


def test_bench_train_predicts_the_placement_with_gpu_ms(capsys):
    assert main(["bench", "train", "--preset", "stories110m", "--chip", "m4", "--batch-size", "1",
                 "--grad-accum", "10", "--no-measure", "--head-on", "gpu", "--embed-on", "gpu", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["head_on"] == "gpu" and r["embed_on"] == "gpu" and r["predicted_breakdown"]["gpu_ms"] > 0
    assert r["predicted_step_ms"] == pytest.approx(sum(r["predicted_breakdown"].values()))


def test_training_with_the_ends_on_the_torch_device_logs_the_all_device_losses_and_resumes(
        tmp_path, corpus, monkeypatch, gpu_is_cpu):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    ane = train(tmp_path / "ane", corpus, **{"head-on": "ane"})
    gpu = train(tmp_path / "gpu", corpus, **{"head-on": "gpu", "embed-on": "gpu"})
    assert {(r["head_on"], r["embed_on"]) for r in gpu.values()} == {("gpu", "gpu")}
    for step in ane:  # the ANE's fp16 logits against float32: the runs drift apart a little
        assert abs(gpu[step]["loss"] - ane[step]["loss"]) <= 2e-2 * ane[step]["loss"], step
    shutil.copytree(tmp_path / "gpu", tmp_path / "half")  # as if killed after the step-10 checkpoint
    (tmp_path / "half" / "checkpoints" / "step-000020.safetensors").unlink()
    assert main(["train", "--out", str(tmp_path / "half"), "--resume", "--device", "emulator"]) == 0
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "half") if "loss" in r}
    assert resumed == {s: r["loss"] for s, r in gpu.items()}
    settings = json.loads((tmp_path / "half" / "config.json").read_text())["anelm_train"]
    assert (settings["head_on"], settings["embed_on"]) == ("gpu", "gpu")


def test_gpu_without_one_is_one_line(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.delenv("ANELM_GPU", raising=False)
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has a GPU torch can use")
    rc = main(["train", f"--data={corpus}", "--steps=1", "--head-on=gpu", f"--out={tmp_path / 'r'}",
               "--device=emulator"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) >= 1 and err[-1].startswith("anelm: error: gpu placement: torch finds no GPU")
