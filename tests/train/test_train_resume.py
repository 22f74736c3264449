"""`anelm train --resume`: a run SIGKILLed at a random moment and resumed logs the same losses
as a straight run; a finished run has nothing to do; bad checkpoints are refused in one line.

The runs are real CLI processes on the emulator with the real device step (tiny preset at
2x16 tokens, so a step takes a fraction of a second).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from anelm.cli.main import main
from anelm.train.data.corpus import write_corpus
from anelm.train.metrics import read_metrics

from helpers import kill_after, steps_logged

STEPS = 24


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    data = write_corpus(base / "stories.txt", n_bytes=30_000, seed=5)
    e = {**os.environ, "ANELM_CACHE_DIR": str(base / "cache"), "PYTHONUNBUFFERED": "1"}
    e.pop("ANELM_PROFILE", None)
    return base, data, e


@pytest.fixture(autouse=True)
def cache_dir(env, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", env[2]["ANELM_CACHE_DIR"])


def flags(data, out, **over):
    f = {"data": data, "steps": STEPS, "batch-size": 2, "seq-len": 16, "bpe-vocab-size": 300,
         "save-every": 3, "eval-every": 6, "eval-batches": 1, "sample-tokens": 0, "lr": 3e-3,
         "out": out, "device": "emulator"}
    f.update(over)
    return [f"--{k}={v}" for k, v in f.items()]


def cli(args, e, **kw):
    return subprocess.Popen([sys.executable, "-m", "anelm", "train", *args], env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def losses(run):
    recs = [r for r in read_metrics(run) if "loss" in r]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in recs}


@pytest.fixture(scope="module")
def runs(env):
    """A straight run, and a run killed at a random moment after its first checkpoint and
    then resumed; both run concurrently with each other."""
    base, data, e = env
    straight = cli(flags(data, base / "straight"), e)
    killed_dir = base / "killed"
    proc = cli(flags(data, killed_dir), e)
    kill_after([proc], killed_dir / "checkpoints" / "step-000003.safetensors", 120, 1.0,
               late=lambda: steps_logged(killed_dir) >= STEPS - 2)
    ran = max(losses(killed_dir), default=0)
    resumed = cli(["--out", str(killed_dir), "--resume", "--device", "emulator"], e)
    out_r, err_r = resumed.communicate(timeout=300)
    out_s, err_s = straight.communicate(timeout=300)
    assert straight.returncode == 0, err_s[-2000:]
    assert resumed.returncode == 0, err_r[-2000:]
    return base, killed_dir, proc.returncode, ran, err_r


def test_killed_and_resumed_run_logs_the_straight_run_losses(runs):
    base, killed, code, ran, err = runs
    assert code == -signal.SIGKILL
    assert ran < STEPS, "the run finished before the kill; nothing was resumed"
    assert "resuming at step" in err
    a, b = losses(base / "straight"), losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= 1e-4, f"resumed losses differ from the straight run by {worst}"
    evals = lambda r: {x["step"]: x["eval_loss"] for x in read_metrics(r) if "eval_loss" in x}  # noqa: E731
    assert evals(base / "straight").keys() == evals(killed).keys() == {6, 12, 18, 24}


def test_resuming_a_finished_run_has_nothing_to_do(runs, env, capsys):
    _, killed, *_ = runs
    before = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert main(["train", "--out", str(killed), "--resume", "--device", "emulator"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == before


def copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def error_of(capsys, argv, code=1):
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anelm: error: "), err
    return err[0]


def test_corrupt_checkpoint_is_refused_and_kept(runs, tmp_path, capsys):
    run = copy_run(runs[1], tmp_path / "run")
    latest = sorted((run / "checkpoints").iterdir())[-1]
    latest.write_bytes(latest.read_bytes()[:5000])  # truncated, as a failing disk would leave it
    size = latest.stat().st_size
    msg = error_of(capsys, ["train", "--out", str(run), "--resume", "--steps", "30"])
    assert "corrupt" in msg and latest.name in msg
    assert latest.stat().st_size == size  # nothing deleted or rewritten


def test_checkpoint_of_another_model_is_refused(runs, tmp_path, capsys):
    run = copy_run(runs[1], tmp_path / "run")
    cfg = json.loads((run / "config.json").read_text())
    cfg["hidden_size"] = 64  # the folder now describes a different model from its checkpoints
    (run / "config.json").write_text(json.dumps(cfg))
    msg = error_of(capsys, ["train", "--out", str(run), "--resume", "--steps", "30"])
    assert "hidden_size" in msg and "expected the same model" in msg


def test_resume_needs_a_run(tmp_path, capsys):
    msg = error_of(capsys, ["train", "--out", str(tmp_path / "none"), "--resume"])
    assert "nothing to resume" in msg
    msg = error_of(capsys, ["train", "--resume"], code=2)
    assert "--resume needs --out" in msg


def test_ctrl_c_saves_the_step_reached_and_resume_continues(runs, env):
    """SIGINT stops after the step in progress with its checkpoint (no periodic one before the
    end here), exit 130; the resumed run logs the straight run's losses."""
    import time

    base, data, e = env
    out = base / "interrupted"
    proc = cli(flags(data, out, **{"save-every": 1000}), e)
    deadline = time.monotonic() + 120
    while len(losses(out) if (out / "metrics.jsonl").is_file() else {}) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its second step"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    reached = max(losses(out))
    assert reached < STEPS and f"checkpoint of step {reached}" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{reached:06d}.safetensors"]
    resumed = cli(["--out", str(out), "--resume", "--device", "emulator"], e)
    _, err_r = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err_r[-2000:]
    a, b = losses(base / "straight"), losses(out)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-4
