"""BLAS thread limits for code that runs BLAS on two threads at once.

The training step overlaps the emulator's matmuls (main thread) with dW (a worker thread).
Each BLAS call would otherwise start one thread per core; on a 2-core machine the
oversubscribed, spin-waiting threads made a `tiny` step ~10x slower (1.3 s vs 7-15 s).
"""

from __future__ import annotations

import os

from threadpoolctl import threadpool_limits


def share_blas_between(workers: int = 2):
    """Cap BLAS at cores // workers threads; returns a handle whose `restore_original_limits()`
    puts the process back as it was."""
    per = max(1, (os.cpu_count() or workers) // workers)
    return threadpool_limits(limits=per, user_api="blas")
