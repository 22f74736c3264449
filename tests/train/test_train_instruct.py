"""Instruction fine-tuning runs (docs/fine-tuning.md) on a tiny HF Llama with a word tokenizer and a
chat template (`instruct_tiny`), in process, on the emulator at 2x24 tokens.

What is checked: an eval record at step 0 and at every --eval-every, over the whole valid set;
RUN/best/ and RUN/best.json at the lowest eval loss (the adapter of that step's checkpoint, or an
HF folder transformers loads); --patience stops the run; packing changes no loss (the step-0
eval with and without it); the three record shapes train, in `finetune` and `train --init-from`;
a run killed after a checkpoint resumes to the straight run's losses (the example order is a
function of the seed and the epoch); bad records are one line before the model loads.
"""

import json
import shutil

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.train import validation
from anelm.train.checkpoint import load_checkpoint
from anelm.train.metrics import read_metrics

import hf_tiny
import instruct_tiny

STEPS = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("instruct")
    hf_tiny.make_word_model(folder / "model")
    instruct_tiny.add_chat_template(folder / "model")
    for shape in ("messages", "prompt", "text"):
        instruct_tiny.write_set(folder / shape, shape)
    return folder


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))


def run(base, out, command="finetune", shape="messages", **over):
    f = {"model" if command == "finetune" else "init-from": base / "model", "data": base / shape,
         "steps": STEPS, "batch-size": 2, "seq-len": 24, "eval-every": 2, "save-every": 2, "keep-last": 0,
         "sample-tokens": 0, "lr": 5e-2, "out": out, "device": "emulator"}
    f.update(over)
    args = [command] + [f"--{k}" if v is True else f"--{k}={v}" for k, v in f.items() if v is not None]
    assert main(args) == 0
    return out


def evals(out) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r}


def test_finetune_evaluates_from_step_0_and_keeps_the_best_adapter(base, tmp_path):
    from safetensors.numpy import load_file

    out = run(base, tmp_path / "run")
    ev = evals(out)
    assert sorted(ev) == [0, 2, 4, 6, 8]
    assert min(ev.values()) < 0.95 * ev[0], ev  # the answers follow from the prompts: learnable
    best = json.loads((out / "best.json").read_text())
    assert best["step"] == min(ev, key=ev.get) and best["eval_loss"] == pytest.approx(min(ev.values()))
    held = load_file(out / "best" / "adapter_model.safetensors")
    ck = load_checkpoint(out / "checkpoints" / f"step-{best['step']:06d}.safetensors").weights
    assert len(held) == len(ck) > 0
    for name, t in held.items():
        np.testing.assert_array_equal(t, ck[name.removeprefix("base_model.model.")])
    assert (out / "loss.png").stat().st_size > 0
    recs = [r for r in read_metrics(out) if "loss" in r]
    assert all(r["counted_tokens_per_s"] > 0 for r in recs)


def test_packing_changes_no_loss(base, tmp_path):
    """The step-0 eval (the whole valid set, each example attending to itself only) packed and
    padded: the same per-token arithmetic, so equal to float32 round-off of the sums."""
    packed = evals(run(base, tmp_path / "packed", steps=1))[0]
    padded = evals(run(base, tmp_path / "padded", steps=1, **{"no-pack": True}))[0]
    assert abs(packed - padded) <= 1e-5 * padded, (packed, padded)


@pytest.mark.parametrize("shape", ["prompt", "text"])
def test_other_shapes_train_the_whole_model_and_best_is_an_hf_folder(base, tmp_path, shape):
    import torch
    from transformers import AutoModelForCausalLM

    out = run(base, tmp_path / shape, command="train", shape=shape, lr=5e-3)
    ev = evals(out)
    assert min(ev.values()) < ev[0], ev
    model = AutoModelForCausalLM.from_pretrained(out / "best")
    step = json.loads((out / "best.json").read_text())["step"]
    ck = load_checkpoint(out / "checkpoints" / f"step-{step:06d}.safetensors").weights
    got = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(got, ck["model.layers.0.self_attn.q_proj.weight"])
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


def test_patience_stops_after_evals_without_a_new_best(base, tmp_path, monkeypatch, capsys):
    scripted = iter([3.0, 2.0, 2.5, 2.1, 2.6, 1.0])  # best at step 2, then two evals above it

    monkeypatch.setattr(validation.Validation, "evaluate", lambda self, dev: next(scripted))
    out = run(base, tmp_path / "run", patience=2)
    assert sorted(evals(out)) == [0, 2, 4, 6]
    assert json.loads((out / "best.json").read_text()) == {"step": 2, "eval_loss": 2.0}
    assert "early stop at step 6" in capsys.readouterr().err
    assert (out / "checkpoints" / "step-000006.safetensors").is_file()


def test_a_killed_run_resumes_to_the_straight_losses(base, tmp_path):
    straight = run(base, tmp_path / "straight")
    killed = tmp_path / "killed"
    shutil.copytree(straight, killed)
    for step in (6, 8):  # as if killed after the checkpoint of step 4
        (killed / "checkpoints" / f"step-{step:06d}.safetensors").unlink()
    assert main(["finetune", "--out", str(killed), "--resume", "--device", "emulator"]) == 0
    a, b = ({r["step"]: r.get("loss", r.get("eval_loss")) for r in read_metrics(x)} for x in (straight, killed))
    assert a.keys() == b.keys() and max(abs(a[s] - b[s]) for s in a) <= 1e-6


@pytest.mark.parametrize("line, expected", [
    ('{"messages": [{"role": "user", "content": "w5"}]}', "train.jsonl:3:"),
    ('{"prompt": "w5", "completion": "w6"}', "train.jsonl:3:"),
    ("{not json", "train.jsonl:3:"),
])
def test_a_bad_record_is_one_line_before_the_model_loads(base, tmp_path, capsys, line, expected):
    data = tmp_path / "data"
    instruct_tiny.write_set(data, n_train=2, n_valid=1)
    with open(data / "train.jsonl", "a") as f:
        f.write(line + "\n")
    code = main(["finetune", "--model", str(base / "model"), "--data", str(data), "--out", str(tmp_path / "r"),
                 "--device", "emulator"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("anelm: error: "), err
    assert expected in err[0] and not (tmp_path / "r").exists()
