"""BLAS thread limits and a work queue, for code that runs BLAS on two threads at once.

The training step overlaps the emulator's matmuls (main thread) with dW (a worker thread).
Each BLAS call would otherwise start one thread per core; on a 2-core machine the
oversubscribed, spin-waiting threads made a `tiny` step ~10x slower (1.3 s vs 7-15 s).
Phases with nothing running beside them (the forward pass) take every core back.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Callable

from threadpoolctl import ThreadpoolController

_controller: ThreadpoolController | None = None
# a pass split into independent chunks (AdamW's update, the dynamic pipeline's restaging) takes
# one worker per core, up to this many; the cost model prices such passes by the same count
# (bench/step_model.py `pass_bytes_per_s`)
MAX_PASS_WORKERS = 8


def pass_workers(cores: int | None = None) -> int:
    """Workers for a pass split into chunks, on `cores` cores (default: this machine's)."""
    return max(1, min(MAX_PASS_WORKERS, cores if cores is not None else os.cpu_count() or 1))


def _blas() -> ThreadpoolController:
    global _controller
    if _controller is None:  # scans the loaded libraries once; numpy's BLAS is loaded by now
        _controller = ThreadpoolController()
    return _controller


def share_blas_between(workers: int = 2):
    """Cap BLAS at cores // workers threads; returns a handle whose `restore_original_limits()`
    puts the process back as it was (also a context manager)."""
    per = max(1, (os.cpu_count() or workers) // workers)
    return _blas().limit(limits=per, user_api="blas")


def all_blas_threads():
    """Every core for BLAS, as a context manager, for a phase nothing else runs beside."""
    return _blas().limit(limits=os.cpu_count() or 1, user_api="blas")


class Job:
    """One queued call: `result()` waits for it and returns its value (or raises its error)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.seconds = fn, 0.0
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            self._error = e
        self.seconds = time.perf_counter() - t0
        self._done.set()

    def wait(self) -> None:
        self._done.wait()

    def done(self) -> bool:
        """Finished (without waiting): lets a caller act on whichever jobs are ready."""
        return self._done.is_set()

    def result(self) -> Any:
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value


class WorkQueue:
    """A worker thread that runs jobs oldest first, and lets the submitting thread help.

    The training step queues dW products while it runs the device chain; when the chain is
    done, `help_until_done` runs the newest jobs not yet started on the calling thread, so both
    cores work until the queue is empty instead of one waiting for the other.
    """

    def __init__(self, name: str = "anelm-worker"):
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        with self._cond:
            if self._closed:
                raise RuntimeError("WorkQueue is closed")
            self._jobs.append(job)
            self._cond.notify()
        return job

    def help_until_done(self, jobs: list[Job]) -> None:
        """Run queued jobs here, newest first, until none is left; then wait for `jobs`."""
        while True:
            with self._cond:
                if not self._jobs:
                    break
                job = self._jobs.pop()
            job.run()
        for job in jobs:
            job.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:  # closed and drained
                    return
                job = self._jobs.popleft()
            job.run()
