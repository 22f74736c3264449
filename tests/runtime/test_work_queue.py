"""WorkQueue: the dW worker of the training step, which the submitting thread helps empty."""

import threading

import pytest

from anelm.runtime.threads import WorkQueue


def test_results_errors_and_who_ran_what():
    q = WorkQueue("test-worker")
    gate, started = threading.Event(), threading.Event()
    ran_on: dict[int, str] = {}

    def job(i):
        def run():
            if i == 0:
                started.set()
                gate.wait(5)  # holds the worker, so jobs 1..4 stay queued
            ran_on[i] = threading.current_thread().name
            if i == 3:
                raise ValueError("job 3 failed")
            return i * i
        return run

    jobs = [q.submit(job(0))]
    assert started.wait(5)  # the worker has job 0 before the others are queued
    jobs += [q.submit(job(i)) for i in range(1, 5)]
    helper = threading.Timer(0.2, gate.set)  # lets the worker go on while the caller helps
    helper.start()
    q.help_until_done(jobs)
    helper.join()
    assert [jobs[i].result() for i in (0, 1, 2, 4)] == [0, 1, 4, 16]
    with pytest.raises(ValueError, match="job 3"):
        jobs[3].result()
    assert ran_on[0] == "test-worker"
    assert ran_on[4] == threading.current_thread().name  # the newest job went to the helper
    assert all(j.seconds >= 0 for j in jobs)
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(lambda: 1)


def test_close_finishes_queued_jobs():
    q = WorkQueue()
    jobs = [q.submit(lambda i=i: i + 1) for i in range(20)]
    q.close()
    assert [j.result() for j in jobs] == list(range(1, 21))
