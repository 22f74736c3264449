"""Gradient all-reduce in float32 buckets, started while the backward is still running.

`DeviceTrainStep.loss_and_grads(..., sink=reducer)` offers the reducer each group of
gradients as the backward produces it: the classifier's right after the loss, then one group
per layer, last layer first. A group's matrices are still dW jobs on the worker thread
(`runtime.threads.Job`) when it is offered. After each offer the reducer launches every
group at the head of its queue whose jobs are done: it copies them into that group's bucket
(one float32 buffer, reused every step) and starts an async gloo all-reduce on it. So the
sum of layer L's gradients travels while the device runs layer L-1's backward. `finish`
adds the rest (final norm, embedding), launches what is left, waits, and returns the summed
gradients as views into the buckets.

Launches happen on the main thread, in queue order, so every rank starts the same
collectives in the same order (gloo matches them by order) whichever dW finished first.

With gradient accumulation the reducer runs on the last micro-batch only, with the
accumulated sum of the earlier ones as `base`: bucket = base + grads, one all-reduce per
optimizer step, as torch DDP's `no_sync` does.

The sum (not the mean) comes back: the trainer folds 1/WORLD_SIZE into the one factor that
already unscales and clips (`optim.update_scale`). Any inf/NaN on any rank makes the sum
non-finite on every rank, so the loss scaler skips the step everywhere.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ...runtime.threads import Job

F32 = np.float32


class _Bucket:
    """One group's float32 buffer and the views its gradients occupy."""

    def __init__(self, layout: tuple[tuple[str, tuple[int, ...]], ...]):
        import torch

        self.layout = layout
        self.buf = np.empty(sum(int(np.prod(s)) for _, s in layout), F32)
        self.tensor = torch.from_numpy(self.buf)  # shares the memory: no copy either way
        self.views, lo = {}, 0
        for name, shape in layout:
            n = int(np.prod(shape))
            self.views[name] = self.buf[lo:lo + n].reshape(shape)
            lo += n


class GradReducer:
    """The step's gradient sink for one process group (see module doc)."""

    def __init__(self, group):
        self.group = group
        self._buckets: list[_Bucket] = []
        self.begin()

    def begin(self, base: dict[str, np.ndarray] | None = None) -> None:
        """Start a step; `base`: gradients to add in (earlier micro-batches), or None."""
        self.base = base
        self._queue: deque[dict] = deque()
        self._offered: set[str] = set()
        self._works: list = []
        self._used = 0                  # buckets launched this step
        self._t_first: float | None = None
        self._t_done: list[float] = []
        self.stats: dict = {}

    def offer(self, entries: dict[str, Job | np.ndarray]) -> None:
        """A group of gradients by name, as arrays or dW jobs; launched once all are done."""
        if entries:
            self._queue.append(dict(sorted(entries.items())))
            self._offered.update(entries)
        self._launch(block=False)

    def finish(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Reduce whatever was not offered, wait for every bucket; the summed gradients."""
        self.offer({n: g for n, g in grads.items() if n not in self._offered})
        self._launch(block=True)
        t0 = time.perf_counter()
        for work in self._works:
            self.group.wait(work)
        t_end = time.perf_counter()
        out = {n: v for b in self._buckets[:self._used] for n, v in b.views.items()}
        assert set(out) == set(grads), "every gradient goes through exactly one bucket"
        done = max(self._t_done, default=t_end)  # completion callbacks; the wait as fallback
        self.stats = {"allreduce_ms": round(1e3 * (done - (self._t_first or done)), 3),
                      "allreduce_wait_ms": round(1e3 * (t_end - t0), 3),
                      "allreduce_bytes": int(sum(b.buf.nbytes for b in self._buckets[:self._used]))}
        return out

    def _launch(self, block: bool) -> None:
        while self._queue and (block or all(_done(v) for v in self._queue[0].values())):
            group = self._queue.popleft()
            values = {n: (v.result() if isinstance(v, Job) else v) for n, v in group.items()}
            bucket = self._bucket(tuple((n, tuple(a.shape)) for n, a in values.items()))
            for n, g in values.items():
                if self.base is not None:
                    np.add(self.base[n], g, out=bucket.views[n])
                else:
                    bucket.views[n][...] = g
            if self._t_first is None:
                self._t_first = time.perf_counter()
            work = self.group.all_reduce_async(bucket.tensor)
            work.get_future().then(lambda _: self._t_done.append(time.perf_counter()))
            self._works.append(work)

    def _bucket(self, layout) -> _Bucket:
        """The next bucket of this step, (re)made when its layout is new."""
        i = self._used
        self._used += 1
        if i == len(self._buckets):
            self._buckets.append(_Bucket(layout))
        elif self._buckets[i].layout != layout:
            self._buckets[i] = _Bucket(layout)
        return self._buckets[i]


def _done(v) -> bool:
    return v.done() if isinstance(v, Job) else True
