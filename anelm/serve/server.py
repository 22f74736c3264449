"""The HTTP layer of `anelm serve` (docs/serving.md): the standard library's threading HTTP server.

    server = make_server(worker, model_id, host="127.0.0.1", port=8080, api_key=None)
    server.serve_forever()

Why `http.server` and not an ASGI stack: every request ends in the one device worker
(`worker.py`), so an event loop would only hand requests to a queue, as a thread per
connection does; a local server for one user's apps needs no more, and it adds no
dependency (mlx-lm's server made the same choice). One thread per connection reads the
request, checks it (`protocol`), queues it, and writes what the worker yields: a JSON body, or
server-sent events (`data: {...}` per chunk, `data: [DONE]` at the end). While it waits it
watches its socket, so a client that goes away, queued or mid-stream, cancels its job at once.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions. Errors are
OpenAI's error object with a 4xx (a 5xx only for the server's own failure); a body that is not
JSON, too large, or of the wrong shape never reaches the device.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .protocol import ApiError, parse_chat, parse_completion
from .respond import Reply

MAX_BODY = 16 << 20  # bytes: far past any prompt the context holds
POLL_S = 0.05  # how often a waiting handler checks that its client is still there


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung client never keeps the process alive
    allow_reuse_address = True

    def __init__(self, address, worker, model_id: str, api_key: str | None):
        self.worker, self.model_id, self.api_key = worker, model_id, api_key
        super().__init__(address, Handler)


def make_server(worker, model_id: str, host: str = "127.0.0.1", port: int = 8080,
                api_key: str | None = None) -> Server:
    return Server((host, port), worker, model_id, api_key)


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"  # keep-alive, as the openai client's connection pool expects

    def log_message(self, fmt, *args) -> None:  # one line per request on stderr, without the date
        sys.stderr.write(f"anelm: {self.address_string()} {fmt % args}\n")

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            return self._json(200, {"status": "ok"})
        if not self._authorized():
            return
        if path == "/v1/models":
            return self._json(200, {"object": "list", "data": [
                {"id": self.server.model_id, "object": "model", "created": int(time.time()), "owned_by": "anelm"}]})
        m = f"/v1/models/{self.server.model_id}"
        if path == m:
            return self._json(200, {"id": self.server.model_id, "object": "model", "created": int(time.time()),
                                    "owned_by": "anelm"})
        self._error(ApiError(f"no route GET {path}", None, status=404, code="not_found"))

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        parse = {"/v1/chat/completions": parse_chat, "/v1/completions": parse_completion}.get(path)
        try:
            body = self._body()
            if parse is None:
                raise ApiError(f"no route POST {path}", None, status=404, code="not_found")
            if not self._authorized():
                return
            req = parse(body, self.server.model_id)
        except ApiError as e:
            return self._error(e)
        job = self.server.worker.submit(req)
        reply = Reply(req, self.server.worker.engine)
        try:
            if req.stream:
                self._stream(job, reply)
            else:
                self._whole(job, reply)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            job.cancel()  # the client is gone: its job stops before its next token

    # ---------------------------------------------------------------- replies
    def _whole(self, job, reply: Reply) -> None:
        for kind, value in job.events(timeout=POLL_S):
            if kind == "wait":
                if self._client_gone():
                    job.cancel()
                    return
            elif kind == "error":
                return self._error(value)
            elif kind == "delta":
                reply.add(value)
            elif kind == "done":
                return self._json(200, reply.whole(value))

    def _stream(self, job, reply: Reply) -> None:
        started = False
        for kind, value in job.events(timeout=POLL_S):
            if kind == "wait":
                if self._client_gone():
                    job.cancel()
                    return
                continue
            if kind == "error" and not started:
                return self._error(value)
            if not started:
                self._start_events()
                started = True
            if kind == "error":  # mid-stream: an error event, as OpenAI's streams carry them
                self._event(value.body())
                break
            for chunk in (reply.chunks(value) if kind == "delta" else reply.last_chunks(value)):
                self._event(chunk)
        if started:
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's
        self.end_headers()
        self.close_connection = True

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    # ---------------------------------------------------------------- plumbing
    def _body(self):
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            self.close_connection = True
            raise ApiError(f"the request body must have a Content-Length of at most {MAX_BODY} bytes", None,
                           status=413 if n > MAX_BODY else 400)
        raw = self.rfile.read(n)
        try:
            return json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(f"the request body is not JSON: {e}", None) from None

    def _authorized(self) -> bool:
        key = self.server.api_key
        if key is None or self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._error(ApiError("a valid API key is required: 'Authorization: Bearer KEY'", None, status=401,
                             code="invalid_api_key"))
        return False

    def _client_gone(self) -> bool:
        """True when the client closed its end: its socket reads as readable with nothing to read."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _error(self, e: ApiError) -> None:
        try:
            HTTPStatus(e.status)
        except ValueError:
            e.status = 400
        self._json(e.status, e.body())
