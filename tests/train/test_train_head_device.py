"""The classifier and its loss on the device in vocabulary tiles (`--head-on ane`).

The tiles' join (train/steps/head_device.py) against `cpu_ops.head_loss` in float32: the loss, dx
and dW within the tolerances of one matmul against float32 (docs/testing.md: 1e-2, cosine ≥
0.999 for the gradients), with ignored targets, two sequences, a last tile shorter than the
others and a kernel wider than the sequence (strict's 16 columns). A whole step with the head
on the device against the CPU head; `anelm train --head-on ane` on the tiny model for 20
steps logs the CPU head's losses within the training tolerance, and resumes exactly.
"""

import json
import shutil

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.cli.main import main
from anelm.device.emulator import Emulator
from anelm.errors import UsageError
from anelm.models.config import LlamaConfig
from anelm.train.steps import cpu_ops as ops
from anelm.train.data.corpus import write_corpus
from anelm.train.steps.head_device import DeviceHead, tile_rows
from anelm.train.init import init_weights
from anelm.train.metrics import read_metrics
from anelm.train.steps.placement import resolve_head
from anelm.train.steps.llama import DeviceTrainStep


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def cos(a, b):
    return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("s, width", [(16, 16), (12, 16)])
def test_tiles_join_to_the_cpu_head(s, width):
    rng = np.random.default_rng(0)
    v, d, b = 1100, 32, 2  # tiles of 512: two full, one of 76 rows
    w = (rng.standard_normal((v, d)) * 0.4).astype(np.float32)
    xf = rng.standard_normal((d, b * s)).astype(np.float32)
    t = rng.integers(0, v, b * s)
    t[[1, 7]] = ops.IGNORE
    head = DeviceHead(Emulator(STRICT), v, d, s, width, 512)
    assert [x.stop - x.start for x in head.tiles] == [512, 512, 76]
    head.set_weights(w)
    loss, dx, dw = head.loss_and_grads(w, xf, t, 256.0)
    ref_loss, ref_dx, ref_dw = ops.head_loss(w, xf, t, 256.0)
    got_dw, want_dw = dw(), ref_dw()
    assert abs(loss - ref_loss) / ref_loss < 1e-3
    assert rel(dx, ref_dx) < 1e-2 and cos(dx, ref_dx) > 0.999
    assert rel(got_dw, want_dw) < 1e-2 and cos(got_dw, want_dw) > 0.999
    assert np.all(dx[:, [1, 7]] == 0)
    buf = np.ones_like(w)  # dW added into a buffer (gradient accumulation)
    _, _, call = head.loss_and_grads(w, xf, t, 256.0, out=buf, add=True)
    np.testing.assert_allclose(call(), 1.0 + got_dw, rtol=1e-5, atol=1e-4)
    head.close()


def test_tile_rows_within_the_compiler_limits():
    assert tile_rows(32000, 256) == 8192 and tile_rows(300, 256) == 300
    assert tile_rows(151936, 16384 - 1024) == 1024


@pytest.mark.parametrize("tied", [True, False])
def test_step_with_the_head_on_the_device_matches_the_cpu_head(tied):
    cfg = LlamaConfig(vocab_size=700, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    w = init_weights(cfg, seed=0)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 700, (2, 16)), rng.integers(0, 700, (2, 16))
    out = {}
    for place in ("cpu", "ane"):
        with DeviceTrainStep(cfg, w, Emulator(STRICT), seq_len=16, head_on=place) as step:
            out[place] = step.loss_and_grads(x, y, 1024.0)[:2]
            w2 = {n: p * 1.01 for n, p in w.items()}
            step.set_weights(w2)  # restaged: the next loss sees the new head
            out[place + "2"] = step.loss(x, y), step.loss_and_grads(x, y, 1.0)[0]
    assert abs(out["ane"][0] - out["cpu"][0]) / out["cpu"][0] < 1e-3
    assert abs(out["ane2"][1] - out["cpu2"][1]) / out["cpu2"][1] < 1e-3
    for n, g in out["cpu"][1].items():
        assert rel(out["ane"][1][n], g) < 5e-2 and cos(out["ane"][1][n], g) > 0.999, n


def test_auto_keeps_the_cpu_head_on_the_emulator_and_refuses_unknown_places():
    assert resolve_head("auto", Emulator(STRICT), 32000, 768, 256, 1, 10) == "cpu"
    assert resolve_head("ane", Emulator(STRICT), 32000, 768, 256, 1, 10) == "ane"
    with pytest.raises(UsageError):
        resolve_head("tpu", Emulator(STRICT), 32000, 768, 256, 1, 10)
    with pytest.raises(UsageError):
        DeviceTrainStep(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                    max_position_embeddings=64), init_weights(LlamaConfig(
                                        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                        max_position_embeddings=64), seed=0),
                        Emulator(STRICT), seq_len=16, head_on="tpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("head") / "stories.txt", n_bytes=30_000, seed=5)


def train(out, data, steps=20, **over):
    flags = {"data": data, "steps": steps, "batch-size": 2, "seq-len": 16, "bpe-vocab-size": 300,
             "save-every": 10, "eval-every": 10, "eval-batches": 1, "sample-tokens": 0, "lr": 3e-3,
             "grad-accum": 2, "out": out, "device": "emulator", **over}
    assert main(["train", *[f"--{k}={v}" for k, v in flags.items()]]) == 0
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


def test_training_with_the_head_on_the_device_logs_the_cpu_heads_losses_and_resumes(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    cpu = train(tmp_path / "cpu", corpus, **{"head-on": "cpu"})
    ane = train(tmp_path / "ane", corpus, **{"head-on": "ane"})
    assert {r["head_on"] for r in cpu.values()} == {"cpu"} and {r["head_on"] for r in ane.values()} == {"ane"}
    for step in cpu:  # fp16 logits: the two runs drift apart a little, step by step
        assert abs(ane[step]["loss"] - cpu[step]["loss"]) <= 2e-2 * cpu[step]["loss"], step
    # as if killed after the step-10 checkpoint: the resumed run logs the straight run's losses
    shutil.copytree(tmp_path / "ane", tmp_path / "half")
    (tmp_path / "half" / "checkpoints" / "step-000020.safetensors").unlink()
    assert main(["train", "--out", str(tmp_path / "half"), "--resume", "--device", "emulator"]) == 0
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "half") if "loss" in r}
    assert resumed == {s: r["loss"] for s, r in ane.items()}
    assert json.loads((tmp_path / "half" / "config.json").read_text())["anelm_train"]["head_on"] == "ane"


def test_lora_step_with_the_head_on_the_device():
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
    for place in ("cpu", "ane"):
        with lora_train_step(cfg, init_weights(cfg, seed=0), Emulator(STRICT), seq_len=16, spec=spec,
                             adapter=adapter, head_on=place) as step:
            out[place] = step.loss_and_grads(x, y, 64.0)[:2]
    assert abs(out["ane"][0] - out["cpu"][0]) / out["cpu"][0] < 1e-3
    for n, g in out["cpu"][1].items():
        assert rel(out["ane"][1][n], g) < 5e-2 and cos(out["ane"][1][n], g) > 0.999, n
