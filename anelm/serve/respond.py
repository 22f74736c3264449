"""A request's generated deltas as OpenAI response objects: one whole body, or stream chunks.

    reply = Reply(request, engine)
    reply.add(delta) ...; body = reply.whole(usage)             # stream: false
    for delta: reply.chunks(delta); then reply.last_chunks(usage) # stream: true

Finish reasons: the generator's "length" and "context" (the context is full) are OpenAI's
"length"; an end-of-sequence token, a stop string and a complete constrained output are "stop".
Log-probabilities are the model's (before sampling's transforms), in each endpoint's format:
chat's `logprobs.content` list of {token, logprob, bytes, top_logprobs}, completions' legacy
{tokens, token_logprobs, top_logprobs, text_offset}.
"""

from __future__ import annotations

from .protocol import Request, chat_chunk, chat_response, completion_chunk, completion_response

LENGTH = ("length", "context")


def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason in LENGTH else "stop"


class Reply:
    def __init__(self, req: Request, engine):
        self.req, self.tok = req, engine.tokenizer
        self.text, self.finish = "", None
        self.entries: list[tuple[int, float, list]] = []  # (token, logprob, top) when logprobs
        self._role_sent = False

    # ------------------------------------------------------------------ deltas
    def add(self, delta) -> None:
        self.text += delta.text
        if delta.finish_reason is not None:
            self.finish = finish_reason(delta.finish_reason)
        if self.req.sampling.get("logprobs") and delta.token is not None and delta.logprob is not None:
            self.entries.append((delta.token, float(delta.logprob), list(delta.top_logprobs or [])))

    def _token(self, token: int) -> str:
        return self.tok.decode([token])

    def _chat_logprobs(self, entries) -> list[dict]:
        def item(t, lp):
            s = self._token(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return [{**item(t, lp), "top_logprobs": [item(u, v) for u, v in top]} for t, lp, top in entries]

    def _completion_logprobs(self, entries, offset: int) -> dict:
        tokens = [self._token(t) for t, _, _ in entries]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self._token(u): v for u, v in top} for _, _, top in entries],
                "text_offset": offsets}

    # ------------------------------------------------------------------ bodies
    def whole(self, use: dict) -> dict:
        want = self.req.sampling.get("logprobs")
        if self.req.kind == "chat":
            return chat_response(self.req, self.text, self.finish or "stop", use,
                                 self._chat_logprobs(self.entries) if want else None)
        return completion_response(self.req, self.text, self.finish or "stop", use,
                                   self._completion_logprobs(self.entries, 0) if want else None)

    def chunks(self, delta) -> list[dict]:
        """The chunks one delta gives (none when it carries no text, no logprob and no finish)."""
        before, n = len(self.text), len(self.entries)
        self.add(delta)
        new = self.entries[n:]
        finish = finish_reason(delta.finish_reason)
        out = []
        if self.req.kind == "chat":
            if not self._role_sent:
                out.append(chat_chunk(self.req, {"role": "assistant", "content": ""}))
                self._role_sent = True
            if delta.text or new or finish:
                out.append(chat_chunk(self.req, {"content": delta.text} if delta.text or new else {}, finish,
                                      self._chat_logprobs(new) if new else None))
        elif delta.text or new or finish:
            out.append(completion_chunk(self.req, delta.text, finish,
                                        self._completion_logprobs(new, before) if new else None))
        return out

    def last_chunks(self, use: dict) -> list[dict]:
        """After the last delta: the usage-only chunk when the client asked for it."""
        if not self.req.include_usage:
            return []
        make = chat_chunk if self.req.kind == "chat" else completion_chunk
        return [make(self.req, *(({},) if self.req.kind == "chat" else ("",)), use=use, choices=False)]
