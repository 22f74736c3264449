"""`anelm train --distributed` (docs/distributed.md): 2 ranks on loopback against one process.

Real CLI processes on the emulator, tiny preset at 2x16 tokens per rank. One job runs under
torchrun (`python -m torch.distributed.run`), the others get RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT from the test, as any other launcher would set them. The jobs run concurrently.

Tolerance of "the same losses as one rank with the doubled batch": the device evaluates each
sequence on its own, so step 1's forward is the same arithmetic either way and its loss
agrees to float32 round-off of the mean (1e-6 relative). From step 2 the weights differ by
the order of the gradient sum (two half-batch BLAS sums added by the all-reduce, against one
sum over the batch), float32 round-off that AdamW can blow up to ±lr on entries whose
gradient is near zero; device activations then round to fp16 differently here and there.
The mean loss over 64 positions moves far less than one fp16 ulp (2^-11 ≈ 4.9e-4 relative):
observed ≤ 2e-5. The bound is 5e-4 relative, one fp16 ulp; sequences sliced wrongly between
the ranks change step 1 alone by ~1e-2.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.train.data.corpus import write_corpus
from anelm.train.metrics import read_metrics

from helpers import kill_after, steps_logged

STEPS = 8
pytestmark = pytest.mark.slow

# Each rank saves its final weights, so the test can compare the ranks (only rank 0 writes
# checkpoints); otherwise this is `anelm` itself.
WRAPPER = """
import os, sys
import numpy as np
from anelm.train import loop
train = loop.Trainer.train
def dumping(self):
    out = train(self)
    np.savez(os.path.join(os.environ["DUMP_DIR"], f"rank{self.sync.rank}.npz"), **self.params)
    return out
loop.Trainer.train = dumping
from anelm.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    data = write_corpus(base / "stories.txt", n_bytes=30_000, seed=5)
    (base / "wrapper.py").write_text(WRAPPER)
    e = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
         "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    for k in ("ANELM_PROFILE", "RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        e.pop(k, None)
    # the tokenizer and its token cache, made once before the jobs start side by side
    assert main(["train", *flags(data, base / "warm", steps=1)]) == 0
    return base, data, e


def flags(data, out, **over):
    f = {"data": data, "steps": STEPS, "batch-size": 2, "seq-len": 16, "bpe-vocab-size": 300,
         "save-every": 2, "eval-every": 4, "eval-batches": 2, "sample-tokens": 0, "lr": 3e-3,
         "out": out, "device": "emulator"}
    f.update(over)
    return [f"--{k.replace('_', '-')}={v}" for k, v in f.items()]


def popen(argv, e, **extra):
    return subprocess.Popen([sys.executable, *argv], env={**e, **extra}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ranks(args, e, timeout=60, **extra):
    """Two `anelm train --distributed` ranks started as a launcher would start them."""
    port = free_port()
    return [popen(["-m", "anelm", "train", "--distributed", f"--dist-timeout={timeout}", *args], e,
                  RANK=str(r), WORLD_SIZE="2", MASTER_PORT=str(port), **extra) for r in (0, 1)]


def finish(procs, timeout=240):
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def records(run):
    return [r for r in read_metrics(run) if "loss" in r]


def losses(run):
    return {r["step"]: r["loss"] for r in records(run)}


def eval_losses(run):
    return {r["step"]: r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r}


def signal_rank_1_after_two_steps(run, procs, sig):
    deadline = time.time() + 180
    while len(records(run)) < 2 and procs[0].poll() is None and time.time() < deadline:
        time.sleep(0.05)
    procs[1].send_signal(sig)


@pytest.fixture(scope="module")
def jobs(env):
    base, data, e = env
    one = popen(["-m", "anelm", "train", *flags(data, base / "one", batch_size=4)], e)
    dump = base / "dump"
    dump.mkdir()
    two = popen(["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                 f"--master-port={free_port()}", str(base / "wrapper.py"), "train", "--distributed",
                 "--dist-timeout=60", *flags(data, base / "two")], e, DUMP_DIR=str(dump))
    endless = {"steps": 500, "save_every": 500, "eval_every": 500}
    lost = {}
    for name, sig in (("dead", signal.SIGKILL), ("hung", signal.SIGSTOP)):
        lost[name] = ranks(flags(data, base / name, **endless), e, timeout=20)
        threading.Thread(target=signal_rank_1_after_two_steps, args=(base / name, lost[name], sig),
                         daemon=True).start()
    killed_dir = base / "killed"
    victims = ranks(flags(data, killed_dir), e)
    codes = kill_after(victims, killed_dir / "checkpoints" / "step-000002.safetensors", 180, 0.5,  # the whole job
                       late=lambda: steps_logged(killed_dir) >= STEPS - 2)
    ran = max(losses(killed_dir), default=0)
    (_, err_resumed), _ = finish(ranks(["--out", str(killed_dir), "--resume", "--device=emulator"], e))
    finish([one, two])
    return base, dump, codes, ran, err_resumed, lost


def test_two_ranks_log_the_losses_of_one_rank_with_the_doubled_batch(jobs):
    base = jobs[0]
    a, b = losses(base / "one"), losses(base / "two")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert abs(a[1] - b[1]) <= 1e-6 * abs(a[1]), (a[1], b[1])  # the same sequences at step 1
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    assert worst <= 5e-4, f"2-rank losses differ from 1 rank with 2x the batch by {worst:.2e} relative"
    ea, eb = eval_losses(base / "one"), eval_losses(base / "two")
    assert ea.keys() == eb.keys() == {4, 8}
    assert max(abs(ea[s] - eb[s]) / ea[s] for s in ea) <= 5e-4
    recs = records(base / "two")
    assert all(r["allreduce_ms"] >= 0 and r["allreduce_bytes"] > 0 for r in recs)
    assert recs[0]["tokens_per_s"] > 0 and "allreduce_ms" not in records(base / "one")[0]


def test_ranks_hold_identical_weights_after_training(jobs):
    base, dump = jobs[0], jobs[1]
    w0, w1 = np.load(dump / "rank0.npz"), np.load(dump / "rank1.npz")
    assert sorted(w0.files) == sorted(w1.files) and len(w0.files) > 10
    for name in w0.files:
        assert np.array_equal(w0[name], w1[name]), f"{name} differs between the ranks"
    from anelm.train.checkpoint import load_checkpoint

    saved = load_checkpoint(base / "two" / "checkpoints" / f"step-{STEPS:06d}.safetensors").weights
    assert all(np.array_equal(saved[n], w0[n]) for n in w0.files)  # rank 0's checkpoint is them


def test_job_killed_and_resumed_logs_the_straight_runs_losses(jobs):
    base, _, codes, ran, err = jobs[:5]
    assert codes == [-signal.SIGKILL] * 2
    assert ran < STEPS, "the job finished before the kill; nothing was resumed"
    assert "resuming at step" in err
    a, b = losses(base / "two"), losses(base / "killed")
    assert sorted(b) == list(range(1, STEPS + 1))
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= 1e-4, f"resumed losses differ from the straight run by {worst}"


def test_another_world_size_than_the_checkpoints_is_one_line(jobs, tmp_path, capsys):
    import shutil

    run = shutil.copytree(jobs[0] / "killed", tmp_path / "run")
    assert main(["train", "--out", str(run), "--resume", f"--steps={STEPS + 2}", "--device=emulator"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "error" in line] == err[-1:], err
    assert err[-1].startswith("anelm: error: ") and "written by 2 rank(s)" in err[-1], err


@pytest.mark.parametrize("how", ["dead", "hung"])
def test_a_killed_or_stopped_rank_ends_the_other_with_one_line_naming_it(jobs, how):
    procs = jobs[-1][how]  # rank 1 got SIGKILL / SIGSTOP once rank 0 had logged two steps
    try:
        _, err = procs[0].communicate(timeout=120)  # --dist-timeout 20: never a hang
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("anelm: error: lost rank 1 "), lines
    assert not any(line.startswith("anelm: error:") for line in lines[:-1])
    assert "Traceback" not in err and "frame #" not in err, err
    if how == "hung":
        assert "timed out: no reply within --dist-timeout" in lines[-1], lines[-1]


def test_without_torch_distributed_is_one_line_saying_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # its import now fails
    assert main(["train", "--distributed", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["anelm: error: --distributed needs PyTorch; install it with "
                   "pip install 'anelm[distributed]'"]
    assert not (tmp_path / "r").exists()


def test_distributed_without_a_launcher_is_one_line(monkeypatch, capsys, tmp_path):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert main(["train", "--distributed", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in err[0] and "torchrun" in err[0]


# ------------------------------------------------------------------ without processes

class FakeWork:
    def wait(self):
        pass

    def get_future(self):
        return self

    def then(self, callback):
        callback(self)


class FakePeer:
    """A group of 2 whose other rank contributes `peer` (by name) to every sum."""

    rank, world = 0, 2

    def __init__(self, peer, reducer):
        self.peer, self.reducer, self.launched = peer, reducer, []

    def all_reduce_async(self, tensor):
        bucket = self.reducer._buckets[self.reducer._used - 1]
        self.launched.append(tuple(bucket.views))
        for n, v in bucket.views.items():
            v += self.peer[n]
        return FakeWork()

    def wait(self, work):
        work.wait()


def test_reducer_sums_buckets_in_offer_order_and_an_inf_anywhere_skips_everywhere():
    from anelm.runtime.threads import WorkQueue
    from anelm.train.distributed.grads import GradReducer
    from anelm.train.optim import update_scale

    rng = np.random.default_rng(0)
    mine = {n: rng.standard_normal(s).astype(np.float32) for n, s in
            (("head", (4, 3)), ("l1.a", (3, 3)), ("l1.b", (3,)), ("l0.a", (3, 3)), ("embed", (5, 3)))}
    peer = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in mine.items()}
    base = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in mine.items()}
    red = GradReducer(None)
    red.group = fake = FakePeer(peer, red)
    pool = WorkQueue("test-dw")
    try:
        red.begin(base)
        red.offer({"head": pool.submit(lambda: mine["head"])})
        red.offer({"l1.b": mine["l1.b"], "l1.a": pool.submit(lambda: mine["l1.a"])})
        red.offer({"l0.a": mine["l0.a"]})
        out = red.finish(dict(mine))
    finally:
        pool.close()
    assert fake.launched == [("head",), ("l1.a", "l1.b"), ("l0.a",), ("embed",)]
    for n in mine:
        np.testing.assert_array_equal(out[n], base[n] + mine[n] + peer[n])
    assert red.stats["allreduce_bytes"] == 4 * sum(a.size for a in mine.values())
    peer["l0.a"][1, 1] = np.inf  # an overflow on the other rank only
    red.begin(None)
    out = red.finish(dict(mine))
    assert not np.isfinite(update_scale(out, 4096.0, 2, 1.0)[0])  # the scaler skips the step


def test_weights_digest_sees_one_changed_value():
    from anelm.train.distributed import digest_mismatch, weights_digest

    w = {"a": np.ones((3, 4), np.float32), "b": np.zeros(5, np.float32)}
    w2 = {k: v.copy() for k, v in w.items()}
    w2["b"][2] = np.float32(1e-30)
    d0, d1 = weights_digest(w), weights_digest(w2)
    assert d0 != d1 and d0 == weights_digest({k: v.copy() for k, v in w.items()})
    assert digest_mismatch(5, [d0, d0]) is None
    msg = digest_mismatch(5, [d0, d1])
    assert "differ at step 5" in msg and "rank 1 against rank 0" in msg


@pytest.mark.parametrize("gloo", [
    "[../gloo/transport/tcp/pair.cc:534] Timed out waiting 16000ms for recv operation to complete",
    "[../gloo/transport/tcp/unbound_buffer.cc:81] Application timeout caused pair closure",
])
def test_either_wording_of_a_gloo_timeout_is_named_a_timeout_in_our_words(gloo):
    from anelm.train.distributed import _reason

    why = _reason(RuntimeError(gloo), 20.0)
    assert why.startswith("timed out: no reply within --dist-timeout 20 s; gloo: "), why
    assert "pair.cc" not in why and "unbound_buffer" not in why
    assert _reason(RuntimeError("[x.cc:1] Connection closed by peer [1.2.3.4]:5"), 20.0) == \
        "Connection closed by peer [1.2.3.4]:5"
