"""Data-parallel training across processes and machines (docs/distributed.md), on torch.distributed.

    torchrun --nproc-per-node 2 -m anelm train --distributed ...     (or any launcher that sets
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and runs `anelm train --distributed` per rank)

    rank 0 prepares the run and broadcasts it (weights, optimizer, scaler, RNG: setup.py)
    each optimizer step, on every rank:
        its slice of every global batch of WORLD_SIZE × --batch-size   (data.Batcher shard=)
        forward + backward on its device; each layer's gradients all-reduced in a float32
        bucket as soon as its dW is done, overlapping the rest of the backward (grads.py)
        the summed gradients, hence the same unscale, clip, scaler decision and AdamW update
    rank 0 alone writes metrics, loss.png and checkpoints; at each checkpoint every rank's
    weights digest is compared.

Backend gloo: CPU tensors over TCP, which is what the trainer has (float32 numpy gradients,
shared with torch without a copy), and Thunderbolt networking is an ordinary interface for it.

Failure: every collective runs under `_guard`. A peer that dies closes its sockets, and the
next collective fails at once; a peer that hangs makes it time out after `--dist-timeout`.
Either way gloo's error says which socket, not which rank, so each rank keeps a heartbeat
(a counter and its collective count) in the launcher's key-value store; the survivor reads
them: a counter that stops moving is a dead or stopped rank, a store that is gone means its
host (rank 0's process, or torchrun's agent) is, and a rank whose collective count lags is
hung. The result is one `LostRank` error line, never a hang or a traceback.

torch is imported here only, and only when `--distributed` is asked for (`join`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from datetime import timedelta

import numpy as np

from ...errors import UsageError
from ..errors import TrainError

INSTALL = "pip install 'anelm[distributed]'"
ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BEAT_S = 0.5   # heartbeat period; a rank silent for 3 periods is taken as lost
DEFAULT_TIMEOUT_S = 300.0


class LostRank(TrainError):
    """A peer rank died, stopped or hung; names it."""


class DistributedError(TrainError):
    """The ranks disagree (weights, data, world size) or cannot start as one job."""


class Solo:
    """The single-process stand-in: what the trainer asks of a group, as no-ops."""

    rank, world, is_main = 0, 1, True

    @property
    def shard(self) -> tuple[int, int]:
        return (self.rank, self.world)

    def reducer(self, base=None):
        """The gradient sink of the step's last micro-batch (None: keep gradients local)."""
        return None

    def mean(self, value: float) -> float:
        return float(value)

    def check_same(self, step: int, params: dict) -> None:
        pass

    def close(self) -> None:
        pass


SOLO = Solo()


def join(timeout_s: float = DEFAULT_TIMEOUT_S) -> "Group":
    """This process's rank in the job the launcher started, or a one-line error."""
    if not os.environ.get("ANELM_DEBUG"):
        # c10d logs each failed socket with a C++ stack trace; a lost rank is reported as
        # one line instead. Read when torch loads, so set before the import.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        import torch.distributed as dist
    except ImportError:
        raise UsageError(f"--distributed needs PyTorch; install it with {INSTALL}") from None
    if not dist.is_available():
        raise UsageError(f"--distributed: this PyTorch has no torch.distributed; install one with {INSTALL}")
    missing = [k for k in ENV if not os.environ.get(k)]
    if missing:
        raise UsageError(f"--distributed expects {', '.join(ENV)} from the launcher (e.g. torchrun "
                         f"--nproc-per-node 2 -m anelm train --distributed ...); {', '.join(missing)} not set")
    return Group(dist, timeout_s)


class Group(Solo):
    """The process group of a job: rank, world size, guarded collectives, heartbeat."""

    def __init__(self, dist, timeout_s: float):
        self.dist, self.timeout_s = dist, float(timeout_s)
        self.rank, self.world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if not 0 <= self.rank < self.world:
            raise UsageError(f"--distributed: expected 0 <= RANK < WORLD_SIZE, got RANK={self.rank} "
                             f"WORLD_SIZE={self.world}")
        self.is_main = self.rank == 0
        self.addr, self.port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT")
        self.collectives = 0   # started so far; the heartbeat publishes it (a hung rank lags)
        self.lost = False
        self._stop = threading.Event()
        # gloo gives up a little before --dist-timeout, leaving the diagnosis time to name
        # the lost rank (3 heartbeat periods) within it
        gloo_s = max(self.timeout_s - 4 * BEAT_S, self.timeout_s / 2)
        try:
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world,
                                    timeout=timedelta(seconds=gloo_s))
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"rank {self.rank}: the {self.world} ranks did not meet at "
                                   f"{self.addr}:{self.port} within --dist-timeout {self.timeout_s:g} s "
                                   f"({_reason(e)})") from None
        # the diagnosis's connection to the store, made now while every rank is healthy: one
        # made after a failure, on a loaded machine, could miss its short deadline and blame
        # the store for a peer's death
        self._probe = self._store(self.timeout_s)
        self._probe.set_timeout(timedelta(seconds=2 * BEAT_S))  # its reads: a stopped host answers never
        self._beat = threading.Thread(target=self._heartbeat, name="anelm-heartbeat", daemon=True)
        self._beat.start()

    # -------------------------------------------------------------- collectives

    @contextmanager
    def _guard(self):
        self.collectives += 1
        try:
            yield
        except RuntimeError as e:  # DistBackendError and gloo's socket errors
            if not self.lost:
                self.lost = True
                atexit.register(_exit_now)
            raise LostRank(self.diagnose(e)) from None

    def reducer(self, base=None):
        from .grads import GradReducer

        if not hasattr(self, "_reducer"):
            self._reducer = GradReducer(self)
        self._reducer.begin(base)
        return self._reducer

    def all_reduce_async(self, tensor):
        """Start a sum over the ranks; returns the handle (wait with `wait`)."""
        with self._guard():
            return self.dist.all_reduce(tensor, async_op=True)

    def wait(self, work) -> None:
        with self._guard():
            work.wait()

    def mean(self, value: float) -> float:
        """The mean of a number over the ranks (float64: the loss is logged as this)."""
        import torch

        t = torch.tensor([float(value)], dtype=torch.float64)
        with self._guard():
            self.dist.all_reduce(t)
        return float(t.item()) / self.world

    def broadcast_object(self, obj):
        """rank 0's `obj` on every rank (picklable)."""
        box = [obj if self.is_main else None]
        with self._guard():
            self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """rank 0's arrays into every rank's arrays of the same names and shapes, in place."""
        import torch

        for name in sorted(arrays):
            a = arrays[name]
            if self.is_main and not (a.flags.writeable and a.flags.c_contiguous):
                a = np.ascontiguousarray(a).copy()  # torch shares only writable memory
            with self._guard():
                self.dist.broadcast(torch.from_numpy(a), src=0)

    def agree(self, problem: str | None) -> None:
        """Every rank raises the first rank's problem, if any rank has one (or goes on)."""
        found = [None] * self.world
        with self._guard():
            self.dist.all_gather_object(found, problem)
        first = next((p for p in found if p), None)
        if first:
            raise DistributedError(first)

    def check_same(self, step: int, params: dict) -> None:
        """Stop every rank with one line when the ranks' weights differ (a cheap digest)."""
        import torch

        mine = torch.tensor([weights_digest(params)], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        with self._guard():
            self.dist.all_gather(every, mine)
        problem = digest_mismatch(step, [int(t.item()) for t in every])
        if problem:
            raise DistributedError(problem)

    def close(self) -> None:
        self._stop.set()
        if self.lost:  # tearing down would wait out the collectives still queued on the lost rank
            return
        try:
            self.dist.destroy_process_group()
        except (RuntimeError, ValueError, AssertionError):  # already gone with a lost peer
            pass

    # ------------------------------------------------------ heartbeat, diagnosis

    def _store(self, timeout_s: float):
        return self.dist.TCPStore(self.addr, self.port, is_master=False,
                                  timeout=timedelta(seconds=timeout_s))

    def _heartbeat(self) -> None:
        try:
            store, n = self._store(self.timeout_s), 0
            while not self._stop.wait(BEAT_S):
                n += 1
                store.set(f"anelm/beat/{self.rank}", f"{n} {self.collectives}")
        except Exception:  # noqa: BLE001 - the store is gone; the collectives report it
            return

    def _beats(self, store) -> dict[int, tuple[int, int]]:
        out = {}
        for r in range(self.world):
            key = f"anelm/beat/{r}"
            if r != self.rank and store.check([key]):
                n, c = store.get(key).decode().split()
                out[r] = (int(n), int(c))
        return out

    def diagnose(self, error: BaseException) -> str:
        """One line naming the lost rank(s), from the heartbeats (at most ~3 periods)."""
        why, who = _reason(error, self.timeout_s), f"rank {self.rank} of {self.world}"
        try:
            before = self._beats(self._probe)
            time.sleep(3 * BEAT_S)
            after = self._beats(self._probe)
        except Exception:  # noqa: BLE001 - no store: its host is gone
            host = "rank 0" if self.rank != 0 else "the launcher's store"
            return f"lost {host} (its process died; the rendezvous store is gone); {who} stopped ({why})"
        others = [r for r in range(self.world) if r != self.rank]
        silent = [r for r in others if r not in after or after[r][0] == before.get(r, (-1,))[0]]
        if silent:
            return (f"lost rank {', '.join(map(str, silent))} (its heartbeat stopped: the process "
                    f"died or is stopped); {who} stopped ({why})")
        behind = [r for r in others if after[r][1] < self.collectives]
        if behind:
            return (f"lost rank {', '.join(map(str, behind))} (alive but hung: no collective within "
                    f"--dist-timeout {self.timeout_s:g} s); {who} stopped ({why})")
        return f"lost contact with the other ranks; {who} stopped ({why})"


# --------------------------------------------------------------------- helpers

def weights_digest(params: dict[str, np.ndarray]) -> int:
    """CRC-32 of every weight's bytes, in name order: one pass at memory speed."""
    crc = 0
    for name in sorted(params):
        crc = zlib.crc32(np.ascontiguousarray(params[name]).data, zlib.crc32(name.encode(), crc))
    return crc


def digest_mismatch(step: int, digests: list[int]) -> str | None:
    """The one-line complaint when the ranks' digests differ, or None."""
    if len(set(digests)) <= 1:
        return None
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    return (f"the ranks' weights differ at step {step} (rank {', '.join(map(str, odd))} against rank 0: "
            "digests " + " ".join(f"{d:08x}" for d in digests) + "); stopped, expected every rank "
            "to apply the same update")


def check_world(ck, world: int) -> None:
    """A checkpoint resumes only in a job of the world size that wrote it: the batch order
    and the sum of the gradients depend on it."""
    wrote = int(ck.extra.get("world_size", 1))
    if wrote != world:
        raise UsageError(f"the checkpoint at step {ck.step} was written by {wrote} rank(s) and this job "
                         f"has {world}; expected WORLD_SIZE={wrote} to resume it")


def _exit_now() -> None:
    """The end of a process that lost a rank, once its error line is out: the collectives
    still queued on the lost rank would otherwise hold the exit until each times out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise UsageError(f"--distributed: expected an integer {name}, got {os.environ[name]!r}") from None


def _reason(e: BaseException, timeout_s: float | None = None) -> str:
    """gloo's message without its source path and advice: e.g. 'Connection reset by peer'.
    A timeout is named in our words first: gloo words it differently with load ('Timed out
    waiting ...' or 'Application timeout caused pair closure')."""
    text = (str(e).splitlines() or [type(e).__name__])[0]
    text = text.split("] ", 1)[-1].split(". This is typically", 1)[0][:160]
    if timeout_s is not None and ("timed out" in text.lower() or "timeout" in text.lower()):
        return f"timed out: no reply within --dist-timeout {timeout_s:g} s; gloo: {text}"
    return text
