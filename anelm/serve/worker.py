"""One device, many clients: requests queue to the one thread that owns the runner.

    worker = DeviceWorker(engine)            # starts its thread
    job = worker.submit(request)             # protocol.Request; FIFO
    for kind, value in job.events(): ...     # ("delta", Delta) ..., then ("done", usage) or ("error", ApiError)
    job.cancel()                             # the client went away: the job ends at its next token

The runner is not thread-safe and the device runs one program at a time, so requests run one
after another in arrival order; a waiting client sees its place in line only as latency. A
cancelled job that has not started is skipped; a running one stops before its next token, and
its KV cache goes back to the prompt cache like any finished one (`generate.chat.PromptCache`),
so the next turn of that conversation still resumes from it.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Iterator

from ..errors import AnelmError
from .protocol import ApiError, Request, usage

END = object()


class Job:
    def __init__(self, req: Request):
        self.req = req
        self._events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, kind: str, value) -> None:
        self._events.put((kind, value))

    def events(self, timeout: float | None = None) -> Iterator[tuple[str, object]]:
        """The job's events in order; with `timeout`, ("wait", None) whenever none came for that
        long (the server checks its client meanwhile)."""
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                yield "wait", None
                continue
            if item is END:
                return
            yield item


class DeviceWorker:
    def __init__(self, engine, prompt_cache=None):
        from ..generate.chat import PromptCache

        self.engine = engine
        self.cache = prompt_cache if prompt_cache is not None else PromptCache(engine.runner)
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="anelm-device", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> Job:
        job = Job(req)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():  # its client left while it waited
                job._events.put(END)
                continue
            try:
                self._run(job)
            except ApiError as e:
                job.put("error", e)
            except AnelmError as e:  # a value the checks upstream let through (a sampling range, a template)
                job.put("error", ApiError(str(e), getattr(e, "param", None)))
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the server
                traceback.print_exc()
                job.put("error", ApiError(f"the server failed on this request: {type(e).__name__}: {e}", None,
                                          status=500, type_="server_error"))
            finally:
                job._events.put(END)

    def _run(self, job: Job) -> None:
        req, eng = job.req, self.engine
        ids = self._prompt(req)
        capacity = eng.context
        if len(ids) >= capacity:
            raise ApiError(f"the prompt is {len(ids)} tokens; this server's context holds {capacity}, "
                           "with room for at least one new token", "messages" if req.kind == "chat" else "prompt",
                           code="context_length_exceeded")
        options = eng.options(**{k: v for k, v in req.sampling.items() if v is not None})
        processors = [c] if (c := eng.constraint(req.response_format)) is not None else []
        cache, _ = self.cache.take(ids)
        generated = []
        try:
            for delta in eng.stream(ids, options, cache=cache, logits_processors=processors):
                if delta.token is not None:
                    generated.append(delta.token)
                job.put("delta", delta)
                if job.cancelled.is_set():
                    break
        finally:
            self.cache.put(list(ids) + generated, cache)
        job.put("done", usage(len(ids), len(generated)))

    def _prompt(self, req: Request) -> list[int]:
        eng = self.engine
        if req.kind == "chat":
            return eng.chat_prompt(req.messages)
        if isinstance(req.prompt, list):
            vocab = eng.config.vocab_size
            if max(req.prompt) >= vocab:
                raise ApiError(f"'prompt' holds token id {max(req.prompt)}; expected ids below {vocab}", "prompt")
            return list(req.prompt)
        return eng.completion_prompt(req.prompt)
