"""Checkpoints: round trip, safetensors compatibility, atomicity, retention, bad files."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from anelm.models.formats import safetensors_io as S
from anelm.train import checkpoint as C
from anelm.train.errors import CheckpointError
from anelm.train.presets import get_preset, hf_weight_shapes

CFG = {**get_preset("tiny"), "num_hidden_layers": 1, "vocab_size": 64, "hidden_size": 16,
       "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}


def make_ckpt(step, seed=0):
    rng = np.random.default_rng(seed)
    w = {n: rng.standard_normal(s).astype(np.float32) for n, s in hf_weight_shapes(CFG).items()}
    opt = {f"{k}.{n}": rng.random(a.shape).astype(np.float32) for n, a in w.items()
           for k in ("exp_avg", "exp_avg_sq")}
    return C.Checkpoint(step=step, config=CFG, weights=w, optimizer=opt,
                        optimizer_state={"step": step, "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8},
                        scaler={"kind": "dynamic", "scale": 2048.0, "clean": 3},
                        rng={"data": {"state": {"state": 2 ** 100 + 7, "inc": 12345}}},
                        data={"drawn": step * 2}, extra={"tokens_seen": 999})


def test_round_trip_and_plain_safetensors_reader(tmp_path):
    ck = make_ckpt(123)
    path = C.save_checkpoint(tmp_path, ck)
    assert path == tmp_path / "checkpoints" / "step-000123.safetensors"
    back = C.load_checkpoint(path, config=CFG, shapes=hf_weight_shapes(CFG))
    assert back.step == 123 and back.config == CFG and back.data == {"drawn": 246}
    assert back.rng["data"]["state"]["state"] == 2 ** 100 + 7  # big ints survive
    assert back.scaler == ck.scaler and back.optimizer_state == ck.optimizer_state
    assert back.extra == {"tokens_seen": 999}
    for src, dst in ((ck.weights, back.weights), (ck.optimizer, back.optimizer)):
        assert set(src) == set(dst) and all(np.array_equal(src[n], dst[n]) for n in src)
    plain = load_file(str(path))  # the reference safetensors reader agrees with our writer
    assert np.array_equal(plain["model.norm.weight"], ck.weights["model.norm.weight"])
    assert "optimizer.exp_avg.model.norm.weight" in plain
    from anelm.train.optim import AdamW

    opt = AdamW(back.weights)  # loaded arrays serve directly as writable master weights
    opt.load_state_dict(back.optimizer, {**back.optimizer_state, "groups": opt.groups})
    opt.step({n: np.ones_like(a) for n, a in back.weights.items()})


def test_latest_and_retention(tmp_path):
    assert C.latest_checkpoint(tmp_path) is None
    for step in (10, 20, 5, 30, 40):
        C.save_checkpoint(tmp_path, make_ckpt(step), keep_last=3)
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [20, 30, 40]
    assert C.latest_checkpoint(tmp_path).name == "step-000040.safetensors"
    C.save_checkpoint(tmp_path, make_ckpt(1_000_000), keep_last=None)  # past 6 digits still sorts
    assert C.latest_checkpoint(tmp_path).name == "step-1000000.safetensors"
    assert len(C.list_checkpoints(tmp_path)) == 4


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    good = C.save_checkpoint(tmp_path, make_ckpt(10))
    before = good.read_bytes()
    calls = {"n": 0}
    real = S._write_array

    def dying(f, a):
        calls["n"] += 1
        if calls["n"] == 5:  # some tensors already on disk
            raise KeyboardInterrupt("killed mid-write")
        real(f, a)

    monkeypatch.setattr(S, "_write_array", dying)
    with pytest.raises(KeyboardInterrupt):
        C.save_checkpoint(tmp_path, make_ckpt(20))
    assert C.latest_checkpoint(tmp_path) == good and good.read_bytes() == before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]  # temp removed
    C.load_checkpoint(good, config=CFG)


def test_stale_temp_from_a_killed_process_is_ignored_then_removed(tmp_path):
    C.save_checkpoint(tmp_path, make_ckpt(10))
    stale = tmp_path / "checkpoints" / ".step-000020.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert C.latest_checkpoint(tmp_path).name == "step-000010.safetensors"
    C.save_checkpoint(tmp_path, make_ckpt(20))
    assert not stale.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_corrupt_files_give_one_line_errors(tmp_path, damage):
    path = C.save_checkpoint(tmp_path, make_ckpt(7))
    raw = path.read_bytes()
    bad = {"truncate": raw[: len(raw) - 100], "garbage": b"\x00\xff" * 500,
           "header": raw[:8] + b"{not json" + raw[17:]}[damage]
    path.write_bytes(bad)
    with pytest.raises(CheckpointError, match="is corrupt") as e:
        C.load_checkpoint(path)
    assert "\n" not in str(e.value)


def test_foreign_safetensors_and_missing_file(tmp_path):
    from safetensors.numpy import save_file

    p = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(p), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="bad metadata"):
        C.load_checkpoint(p)
    with pytest.raises(CheckpointError, match="does not exist"):
        C.load_checkpoint(tmp_path / "nope.safetensors")


def test_mismatched_config_or_shapes(tmp_path):
    path = C.save_checkpoint(tmp_path, make_ckpt(3))
    with pytest.raises(CheckpointError, match="hidden_size=16 but the model has hidden_size=32"):
        C.load_checkpoint(path, config={**CFG, "hidden_size": 32})
    shapes = hf_weight_shapes(CFG)
    shapes["model.norm.weight"] = (17,)
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[16\], expected \[17\]"):
        C.load_checkpoint(path, shapes=shapes)
    shapes = {**hf_weight_shapes(CFG), "lm_head.weight": (64, 16)}
    with pytest.raises(CheckpointError, match="lacks lm_head.weight"):
        C.load_checkpoint(path, shapes=shapes)


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the run folder should be: mkdir fails for root too
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        C.save_checkpoint(blocker, make_ckpt(1))


def test_metadata_is_json_strings(tmp_path):
    from safetensors import safe_open

    path = C.save_checkpoint(tmp_path, make_ckpt(5))
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == C.FORMAT and meta["step"] == "5"
    for key in ("config", "optimizer", "scaler", "rng", "data", "extra"):
        json.loads(meta[key])
