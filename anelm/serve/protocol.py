"""The OpenAI API's request and response objects, checked and built (docs/serving.md).

    req = parse_chat(body, model_id)          # or parse_completion; ApiError names the bad field
    req.messages / req.prompt, req.sampling   # sampling: `SamplingOptions` keywords
    chat_response(...), chat_chunk(...), completion_response(...), completion_chunk(...)

Everything a client sends is checked here, before it reaches the device: a wrong type, a value
out of OpenAI's range, `n` other than 1, an unknown model id, an unsupported field a client
relies on (`tools`, `echo`, `suffix`) is an `ApiError` whose `param` names the field, turned
into OpenAI's error object by the server. Fields that change nothing here (`user`, `store`,
`metadata`, `parallel_tool_calls`) are accepted and ignored, as other local servers do.
Beyond OpenAI's fields, `top_k`, `min_p` and `repetition_penalty` are accepted (as vLLM and
mlx-lm accept them).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4  # OpenAI's limit on stop sequences


class ApiError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    kind: str                               # "chat" or "completion"
    model: str
    stream: bool
    include_usage: bool                     # stream_options.include_usage
    sampling: dict[str, Any]                # SamplingOptions keywords
    messages: list[dict] | None = None      # chat: role and text content
    prompt: str | list[int] | None = None   # completion: text, or token ids
    response_format: dict | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# ------------------------------------------------------------------------------ checks

def _number(body: dict, name: str, lo: float, hi: float, default=None, integer: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(f"'{name}' must be {kind} in [{lo:g}, {hi:g}], got {v!r}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be a boolean, got {v!r}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise ApiError(f"'stop' must be a string or a list of at most {MAX_STOP} strings, got {v!r}", "stop")
    return [s for s in stops if s]


def _logit_bias(body: dict) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError(f"'logit_bias' must be an object of token ids to numbers, got {v!r}", "logit_bias")
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ApiError(f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100 or tid < 0:
            raise ApiError(f"'logit_bias' values must be numbers in [-100, 100] for ids >= 0, got {k}: {b!r}",
                           "logit_bias")
        out[tid] = float(b)
    return out


def _common(body: Any, model_id: str, kind: str) -> tuple[dict, dict]:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("'model' is required: a model id from GET /v1/models", "model")
    if model != model_id:
        raise ApiError(f"the model '{model}' does not exist; this server serves '{model_id}'", "model",
                       status=404, code="model_not_found")
    if _number(body, "n", 1, 128, 1, integer=True) != 1:
        raise ApiError("'n' must be 1: this server generates one choice per request", "n")
    for name in ("tools", "functions", "suffix") + (("echo",) if kind == "completion" else ()):
        if body.get(name) not in (None, False, [], ""):
            raise ApiError(f"'{name}' is not supported by this server", name)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise ApiError("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    stream = _bool(body, "stream")
    sampling = {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1),
        "top_k": _number(body, "top_k", 0, 1 << 31, integer=True),
        "min_p": _number(body, "min_p", 0, 1),
        "seed": _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True),
        "presence_penalty": _number(body, "presence_penalty", -2, 2),
        "frequency_penalty": _number(body, "frequency_penalty", -2, 2),
        "repetition_penalty": _number(body, "repetition_penalty", 1e-6, 10),
        "stop": _stop(body),
        "logit_bias": _logit_bias(body),
    }
    if sampling["top_p"] == 0:
        raise ApiError("'top_p' must be in (0, 1], got 0", "top_p")
    extra = {"stream": stream, "include_usage": bool(stream and opts and opts.get("include_usage"))}
    return sampling, extra


def parse_chat(body: Any, model_id: str) -> Request:
    sampling, extra = _common(body, model_id, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' is required: a non-empty list of {role, content}", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] must have a role of {', '.join(ROLES)}, got {m!r}"[:300], "messages")
        role = "system" if m["role"] == "developer" else m["role"]  # the newer name of system
        clean.append({"role": role, "content": _content(m.get("content"), i)})
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    sampling["max_tokens"] = _number({name: limit}, name, 1, 1 << 31, None, integer=True)
    logprobs = _bool(body, "logprobs")
    top = _number(body, "top_logprobs", 0, 20, None, integer=True)
    if top is not None and not logprobs:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    sampling.update(logprobs=logprobs, top_logprobs=top or 0)
    return Request("chat", body["model"], sampling=sampling, messages=clean,
                   response_format=_response_format(body), **extra)


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts of type text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_completion(body: Any, model_id: str) -> Request:
    sampling, extra = _common(body, model_id, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt)
    if not (isinstance(prompt, str) or ok_ids):
        raise ApiError("'prompt' is required: a string or a list of token ids (one prompt per request)", "prompt")
    sampling["max_tokens"] = _number(body, "max_tokens", 0, 1 << 31, 16, integer=True)  # OpenAI's default: 16
    top = _number(body, "logprobs", 0, 5, None, integer=True)  # completions: how many top ids
    sampling.update(logprobs=top is not None, top_logprobs=top or 0)
    return Request("completion", body["model"], sampling=sampling, prompt=prompt,
                   response_format=_response_format(body), **extra)


def _response_format(body: dict) -> dict | None:
    rf = body.get("response_format")
    if rf is None or rf == {"type": "text"}:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("'response_format' must be {type: text | json_object | json_schema}", "response_format")
    if rf["type"] == "json_schema" and not isinstance((rf.get("json_schema") or {}).get("schema"), dict):
        raise ApiError("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return None if rf["type"] == "text" else rf


# --------------------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(req: Request, obj: str) -> dict:
    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    return {"id": f"{prefix}-{req.id}", "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": None}


def chat_response(req: Request, text: str, finish: str, use: dict, logprobs: list | None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
              "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
              "finish_reason": finish}
    return {**_head(req, "chat.completion"), "choices": [choice], "usage": use}


def chat_chunk(req: Request, delta: dict, finish: str | None = None, logprobs: list | None = None,
               use: dict | None = None, choices: bool = True) -> dict:
    """One streamed chunk; `choices=False` is the last, usage-only chunk of include_usage."""
    out = _head(req, "chat.completion.chunk")
    out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                       "logprobs": {"content": logprobs, "refusal": None} if logprobs else None}] if choices else []
    if req.include_usage:
        out["usage"] = use
    return out


def completion_response(req: Request, text: str, finish: str, use: dict, logprobs: dict | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {**_head(req, "text_completion"), "choices": [choice], "usage": use}


def completion_chunk(req: Request, text: str, finish: str | None = None, logprobs: dict | None = None,
                     use: dict | None = None, choices: bool = True) -> dict:
    out = _head(req, "text_completion")
    out["choices"] = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}] if choices else []
    if req.include_usage:
        out["usage"] = use
    return out
