"""`anelm finetune --distributed` (docs/distributed.md): the adapters' gradients are all-reduced, so
two ranks of batch 2 train the adapters that one rank of batch 4 trains.

Real CLI processes on the emulator over a tiny HF Llama (GQA), launched with RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT as any launcher sets them. Tolerances as in test_train_distributed.py:
losses within 5e-4 relative (one fp16 ulp; the two sides differ only by the order of the
gradient sum, float32 round-off). The final adapters: ‖two − one‖ / ‖one‖ ≤ 5e-2 per tensor
(measured ≤ 1.1e-2, on an A). Not max-based, and looser than the losses: B starts at zero, so
dA starts at zero too and its first non-zero gradients are tiny; AdamW divides by √v, which
turns their round-off into up to ±lr per step on such entries (one entry of 64 moved by 9 % of
max|A| in a trial run). Every checkpoint also compares the ranks' adapters (`Trainer.save`,
`sync.check_same`), so ranks that drifted apart would end the job.
"""

import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

from anelm.train.checkpoint import latest_checkpoint, load_checkpoint
from anelm.train.metrics import read_metrics

import hf_tiny
import instruct_tiny

STEPS = 6
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(base, out, batch, data="words.txt"):
    f = {"model": base / "base", "data": base / data, "steps": STEPS, "batch-size": batch,
         "seq-len": 16, "save-every": STEPS, "eval-every": 3, "eval-batches": 1, "sample-tokens": 0,
         "lr": 1e-2, "rank": 4, "targets": "q_proj,v_proj,up_proj", "out": out, "device": "emulator"}
    return [f"--{k}={v}" for k, v in f.items()]


@pytest.mark.parametrize("data", ["words.txt", "chat"])
def test_two_ranks_train_the_adapters_of_one_rank_with_the_doubled_batch(tmp_path, data):
    """Token windows, and chat records (docs/fine-tuning.md): packed examples, the loss on the answers,
    each rank's micro-batch loss over the global batch's count, eval over the whole valid set."""
    hf_tiny.make_word_model(tmp_path / "base")
    instruct_tiny.add_chat_template(tmp_path / "base")
    instruct_tiny.write_set(tmp_path / "chat", n_train=40, n_valid=7)
    rng = random.Random(0)
    (tmp_path / "words.txt").write_text(" ".join(f"w{rng.randint(3, 40)}" for _ in range(1800)))
    e = {**os.environ, "ANELM_CACHE_DIR": str(tmp_path / "cache"), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    e.pop("ANELM_PROFILE", None)
    cmd = [sys.executable, "-m", "anelm", "finetune"]
    one = subprocess.Popen([*cmd, *flags(tmp_path, tmp_path / "one", 4, data)], env=e, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ddp = ["--distributed", "--dist-timeout=120", *flags(tmp_path, tmp_path / "two", 2, data)]
    if data == "chat":  # under torchrun (it sets RANK, WORLD_SIZE, MASTER_*), gloo on loopback
        two = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                 "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "anelm",
                                 "finetune", *ddp], env=e, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    else:  # as any other launcher would set the variables
        two = [subprocess.Popen([*cmd, *ddp], env={**e, "RANK": str(r)}, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE) for r in (0, 1)]
    for p in (one, *two):
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    rec = lambda run: {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}  # noqa: E731
    a, b = rec(tmp_path / "one"), rec(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[s] - b[s]) / abs(a[s]) for s in a) <= 5e-4
    ev = lambda run: {r["step"]: r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r}  # noqa: E731
    ea, eb = ev(tmp_path / "one"), ev(tmp_path / "two")
    assert ea.keys() == eb.keys() and max(abs(ea[s] - eb[s]) / ea[s] for s in ea) <= 5e-4
    assert all("allreduce_ms" in r for r in read_metrics(tmp_path / "two") if "loss" in r)
    wa = load_checkpoint(latest_checkpoint(tmp_path / "one")).weights
    wb = load_checkpoint(latest_checkpoint(tmp_path / "two")).weights
    assert set(wa) == set(wb) and all("lora_" in n for n in wa)
    assert any(np.abs(v).max() > 0 for n, v in wa.items() if "lora_B" in n)  # trained: B moved from 0
    diff = {n: float(np.linalg.norm(wb[n] - wa[n]) / np.linalg.norm(wa[n])) for n in wa}
    print("adapter norm-relative differences, worst:", max(diff.values()))
    assert max(diff.values()) <= 5e-2, diff
