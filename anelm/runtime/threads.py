"""BLAS thread limits for code that runs BLAS on two threads at once.

The training step overlaps the emulator's matmuls (main thread) with dW (a worker thread).
Each BLAS call would otherwise start one thread per core; on a 2-core machine the
oversubscribed, spin-waiting threads made a `tiny` step ~10x slower (1.3 s vs 7-15 s).
Phases with nothing running beside them (the forward pass) take every core back.
"""

from __future__ import annotations

import os

from threadpoolctl import ThreadpoolController

_controller: ThreadpoolController | None = None


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
