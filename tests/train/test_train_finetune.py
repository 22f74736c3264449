"""`anelm finetune`: LoRA runs on the train loop. A run SIGKILLed at a random moment and resumed
logs the same losses as a straight one, with and without LoRA dropout (its masks are drawn
from the seed and the step); its checkpoints hold the adapters and their AdamW moments and
nothing of the base; RUN/adapter/ is the latest checkpoint's adapter in PEFT's layout (PEFT
loads it, `lora_dropout` included); every step record has `compiles`, flat after the first
step; bad input is one line.

The runs are CLI processes on the emulator over a tiny HF Llama (GQA) with a word tokenizer
(`hf_tiny.make_word_model`), at 2x16 tokens, so a step takes a fraction of a second.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.train.checkpoint import OPT_PREFIX, latest_checkpoint, load_checkpoint
from anelm.train.metrics import read_metrics

import hf_tiny
from helpers import kill_after, steps_logged

STEPS = 12


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("finetune")
    hf_tiny.make_word_model(base / "base")
    rng = random.Random(0)
    words = [f"w{rng.randint(3, 40)}" for _ in range(600)]  # a skewed unigram: something to learn
    (base / "words.txt").write_text(" ".join(words * 3))
    # the kernel cache off: the two runs below start together, and a program one of them compiled
    # would be loaded by the other, not compiled (the compile budget counts cold compiles only), which the
    # compile-count test counts
    e = {**os.environ, "ANELM_CACHE_DIR": str(base / "cache"), "ANELM_KERNEL_CACHE_MB": "0",
         "PYTHONUNBUFFERED": "1"}
    e.pop("ANELM_PROFILE", None)
    return base, e


@pytest.fixture(autouse=True)
def cache_dir(env, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", env[1]["ANELM_CACHE_DIR"])


def flags(base, out, **over):
    f = {"model": base / "base", "data": base / "words.txt", "steps": STEPS, "batch-size": 2,
         "seq-len": 16, "save-every": 3, "eval-every": 6, "eval-batches": 1, "sample-tokens": 0,
         "lr": 1e-2, "rank": 4, "targets": "q_proj,v_proj,down_proj", "out": out, "device": "emulator"}
    f.update(over)
    return [f"--{k}={v}" for k, v in f.items()]


def cli(args, e):
    return subprocess.Popen([sys.executable, "-m", "anelm", "finetune", *args], env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def losses(run):
    recs = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in recs] == sorted({r["step"] for r in recs})
    return {r["step"]: r["loss"] for r in recs}


DROPOUTS = (0.0, 0.3)
_RUNS: dict = {}


@pytest.fixture(scope="module", params=DROPOUTS, ids=lambda p: f"dropout={p}")
def runs(env, request):
    """(base, straight run, killed-then-resumed run, kill's exit code, steps logged before the
    kill, the resume's stderr, dropout) of `--dropout` p."""
    if request.param not in _RUNS:
        _RUNS[request.param] = straight_and_killed(*env, request.param)
    return _RUNS[request.param]


def straight_and_killed(base, e, p):
    """A straight run, and one killed at a random moment after its first checkpoint, then resumed."""
    straight, killed = base / f"straight-{p}", base / f"killed-{p}"
    straight_proc = cli(flags(base, straight, dropout=p), e)
    proc = cli(flags(base, killed, dropout=p), e)
    kill_after([proc], killed / "checkpoints" / "step-000003.safetensors", 180, 0.5,
               late=lambda: steps_logged(killed) >= STEPS - 2)
    ran = max(losses(killed), default=0)
    resumed = cli(["--out", str(killed), "--resume", "--device", "emulator"], e)
    _, err_r = resumed.communicate(timeout=400)
    _, err_s = straight_proc.communicate(timeout=400)
    assert straight_proc.returncode == 0, err_s[-2000:]
    assert resumed.returncode == 0, err_r[-2000:]
    return base, straight, killed, proc.returncode, ran, err_r, p


def test_killed_and_resumed_finetune_logs_the_straight_losses(runs):
    base, straight, killed, code, ran, err, p = runs
    assert code == -signal.SIGKILL and ran < STEPS and "resuming at step" in err
    a, b = losses(straight), losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-4
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(straight) if "eval_loss" in r}
    assert evals[STEPS] < evals[STEPS // 2]  # the adapters learn the skewed unigram (one fixed eval
    # batch; the train losses of 2x16-token batches swing by more than 12 steps teach)


def test_dropout_changes_the_training_but_not_the_first_loss(env):
    """Step 1's loss is the base's whatever p (B starts at zero); later ones differ with dropout."""
    runs = {p: _RUNS.get(p) or straight_and_killed(*env, p) for p in DROPOUTS}
    _RUNS.update(runs)
    plain, dropped = (losses(runs[p][1]) for p in DROPOUTS)
    assert plain[1] == dropped[1]
    assert max(abs(plain[s] - dropped[s]) for s in plain) > 1e-3


def test_compiles_are_in_every_record_and_flat_after_the_first_step(runs):
    _, straight, *_ = runs
    recs = [r for r in read_metrics(straight) if "loss" in r]
    counts = [r["compiles"] for r in recs]
    assert len(counts) == STEPS and counts[0] > 0
    assert counts == [counts[0]] * STEPS, counts


def test_checkpoint_holds_the_adapters_and_peft_loads_run_adapter(runs):
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    base, run, *_, p = runs
    ck = load_checkpoint(latest_checkpoint(run))
    assert ck.step == STEPS
    names = set(ck.weights)
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    assert {n.split(".self_attn.")[-1].split(".mlp.")[-1].split(".")[0] for n in names} == {
        "q_proj", "v_proj", "down_proj"}
    assert set(ck.optimizer) == {f"exp_avg.{n}" for n in names} | {f"exp_avg_sq.{n}" for n in names}
    assert all(not n.startswith(OPT_PREFIX) for n in names)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["anelm_finetune"] == {"rank": 4, "alpha": 16.0, "dropout": p, "base": str(base / "base"),
                                     "targets": ["q_proj", "v_proj", "down_proj"]}
    peft_cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert peft_cfg["base_model_name_or_path"] == str(base / "base") and peft_cfg["r"] == 4
    assert peft_cfg["lora_dropout"] == p
    files = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    for n, a in ck.weights.items():
        assert np.array_equal(files["base_model.model." + n], a), n
    assert any(np.abs(a).max() > 0 for n, a in ck.weights.items() if "lora_B" in n)  # B has trained
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base / "base"), run / "adapter")
    loaded = {n.replace(".default", ""): t.detach().numpy() for n, t in model.named_parameters() if "lora_" in n}
    dropouts = {type(m).__name__: m for n, m in model.named_modules() if n.endswith("lora_dropout.default")}
    assert list(dropouts) == ["Dropout" if p else "Identity"] and getattr(dropouts.get("Dropout"), "p", p) == p
    assert set(loaded) == {"base_model.model." + n for n in names}
    assert all(np.array_equal(loaded["base_model.model." + n], a) for n, a in ck.weights.items())


def test_resuming_a_finished_finetune_has_nothing_to_do(runs, capsys):
    _, _, killed, *_ = runs
    assert main(["finetune", "--out", str(killed), "--resume", "--device", "emulator"]) == 0
    assert "nothing to do" in capsys.readouterr().err


def error_of(capsys, argv, code):
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anelm: error: "), err
    return err[0]


@pytest.mark.parametrize("over,code,words", [
    ({"targets": "q_proj,qkv_proj"}, 2, ["unknown target module 'qkv_proj'", "q_proj"]),
    ({"rank": 0}, 2, ["--rank", "positive integer"]),
    ({"rank": 17}, 1, ["rank 17", "1 <= rank <= 16", "v_proj"]),  # v_proj is 16 wide (GQA 8:2, 64)
    ({"dropout": 1}, 2, ["--dropout", "expected a probability in [0, 1), got '1'"]),
    ({"dropout": -0.1}, 2, ["--dropout", "expected a probability in [0, 1)"]),
    ({"dropout": "nan"}, 2, ["--dropout", "expected a probability in [0, 1)"]),
])
def test_bad_lora_settings_are_one_line(env, tmp_path, capsys, over, code, words):
    base, _ = env
    msg = error_of(capsys, ["finetune", *flags(base, tmp_path / "run", **over)], code)
    assert all(w in msg for w in words), msg
    assert not (tmp_path / "run").exists()  # nothing half-made is left behind


def test_quantized_base_and_static_pipeline_past_the_budget_are_refused(env, tmp_path, capsys):
    base, _ = env
    quant = shutil.copytree(base / "base", tmp_path / "quant")
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "anelm", "scheme": "w8"}
    (quant / "config.json").write_text(json.dumps(cfg))
    msg = error_of(capsys, ["finetune", *flags(base, tmp_path / "q", model=quant)], 1)
    assert "quantized folder" in msg and "finetune" in msg
    profile = tmp_path / "small.json"
    strict = json.loads((__import__("anelm").chip.profile.PROFILE_DIR / "strict.json").read_text())
    profile.write_text(json.dumps({**strict, "compile_budget": 12}))
    msg = error_of(capsys, ["finetune", *flags(base, tmp_path / "s", pipeline="static"),
                            f"--profile={profile}"], 2)
    assert "18 compiles for 2 layers exceed the compile budget of 12" in msg and "--pipeline dynamic" in msg
    assert not (tmp_path / "s").exists() and not (tmp_path / "q").exists()


def test_a_train_run_is_not_resumed_as_a_finetune(env, tmp_path, capsys):
    base, _ = env
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "llama", "anelm_train": {}}))
    msg = error_of(capsys, ["finetune", "--out", str(tmp_path / "t"), "--resume"], 1)
    assert "not a finetune run" in msg
