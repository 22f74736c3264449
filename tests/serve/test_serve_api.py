"""`anelm serve`'s HTTP API (docs/serving.md) driven by the official `openai` client, in process on
loopback, over a tiny HF Llama with a word tokenizer and a chat template on the emulator.

The oracle of every generated text is the generation library itself on the same engine
(`Engine.stream` with the same options): the server must add nothing and lose nothing. Bad
requests get OpenAI's error object naming the field, and the server goes on serving; a client
that drops its stream frees the device at once; three concurrent clients get what each gets
alone; the API key is enforced. The real model's behaviour is test_serve_real.py's.
"""

import http.client
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")

import hf_tiny  # noqa: E402
import instruct_tiny  # noqa: E402
from anelm.generate.chat import PromptCache  # noqa: E402
from anelm.generate.engine import load_engine  # noqa: E402
from anelm.serve.server import make_server  # noqa: E402
from anelm.serve.worker import DeviceWorker  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "model"
    hf_tiny.make_word_model(folder)
    instruct_tiny.add_chat_template(folder)
    return load_engine(folder, device="emulator", max_context=CONTEXT, model_id="tiny", notice=lambda m: None)


def start(engine, api_key=None, prompt_cache=None):
    worker = DeviceWorker(engine, prompt_cache)
    server = make_server(worker, engine.model_id, "127.0.0.1", 0, api_key)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, worker


@pytest.fixture(scope="module")
def served(engine):
    server, worker = start(engine)
    yield server
    server.shutdown()
    server.server_close()
    worker.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.server_address[1]}/v1", api_key="none",
                         max_retries=0, timeout=60)


def reference(engine, ids, **opts):
    """What the library generates for `ids`: (text, tokens, finish reason)."""
    text, tokens, finish = "", [], None
    for d in engine.stream(ids, engine.options(**opts)):
        text += d.text
        tokens += [d.token] if d.token is not None else []
        finish = d.finish_reason or finish
    return text, tokens, finish


MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


def test_health_and_models(client, served):
    conn = http.client.HTTPConnection("127.0.0.1", served.server_address[1], timeout=10)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read()) == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_at_temperature_0_is_the_library_greedy_text_whole_and_streamed(client, engine):
    text, tokens, _ = reference(engine, engine.chat_prompt(MESSAGES), temperature=0, max_tokens=12)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(engine.chat_prompt(MESSAGES))
    assert r.usage.completion_tokens == len(tokens) and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_seeded_sampling_stop_and_length(client, engine):
    ids = engine.completion_prompt("w9 w10 w11")
    text, tokens, _ = reference(engine, ids, temperature=0.9, seed=7, max_tokens=10)
    r = client.completions.create(model="tiny", prompt="w9 w10 w11", temperature=0.9, seed=7, max_tokens=10)
    assert r.choices[0].text == text and r.usage.completion_tokens == len(tokens)
    assert r.choices[0].finish_reason == "length" or len(tokens) < 10
    word = text.split()[1] if len(text.split()) > 1 else text.split()[0]
    cut = client.completions.create(model="tiny", prompt="w9 w10 w11", temperature=0.9, seed=7, max_tokens=10,
                                    stop=[word])
    assert cut.choices[0].text == text[:text.index(word)] and cut.choices[0].finish_reason == "stop"


def test_logprobs_and_top_logprobs(client, engine):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy: the chosen one is the likeliest
        assert entry.logprob <= 0
    legacy = client.completions.create(model="tiny", prompt="w9 w10", temperature=0, max_tokens=4, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == legacy.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)


BAD = [
    ({"messages": None}, 400, "messages"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": " ".join(["w5"] * (CONTEXT + 4))}]}, 400, "messages"),
    ({"model": "gpt-9"}, 404, "model"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
]


@pytest.mark.parametrize("change, status, param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_request_is_an_openai_error_naming_the_field(served, client, change, status, param):
    body = {"model": "tiny", "messages": MESSAGES, **change}
    body = {k: v for k, v in body.items() if v is not None}
    conn = http.client.HTTPConnection("127.0.0.1", served.server_address[1], timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert resp.status == status and err["param"] == param and err["message"] and "type" in err
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices  # still serving


def test_not_json_and_unknown_routes(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.server_address[1], timeout=30)
    conn.request("POST", "/v1/chat/completions", b"{nope", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "not JSON" in json.loads(resp.read())["error"]["message"]
    conn.request("GET", "/v2/anything")
    assert conn.getresponse().status == 404


def test_a_dropped_stream_frees_the_device_at_once(served, client, engine):
    """A stream that could run to the end of the context (EOS barred), dropped after its first
    event: the job stops within a few tokens, and its cache goes back holding only those."""
    import socket

    cache = served.worker.cache
    cache.entries.clear()  # the worker is idle between tests
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "stream": True, "temperature": 1.0,
                       "logit_bias": {"2": -100}}).encode()
    sock = socket.create_connection(("127.0.0.1", served.server_address[1]), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    sock.close()
    deadline = time.monotonic() + 30
    while not cache.entries and time.monotonic() < deadline:  # the job ends and gives its cache back
        time.sleep(0.01)
    held = len(cache.entries[0][0])
    assert held < CONTEXT - 8, (held, len(engine.chat_prompt(MESSAGES)))  # it did not run to the end
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=3).choices


def test_concurrent_clients_each_get_what_they_get_alone(engine):
    # A prompt's path on the device (a bucket, or a held prefix and decode steps) follows what the
    # prompt cache holds, which follows the order requests came in; the paths agree within fp16
    # rounding, not bit for bit, and a sampled token may notice. With no prompt kept, each
    # request's path is its prompt's alone, so concurrency is all that can change an answer.
    server, worker = start(engine, prompt_cache=PromptCache(engine.runner, max_entries=0))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none",
                           max_retries=0, timeout=60)
    prompts = [[{"role": "user", "content": f"w{k} w{k + 1}"}] for k in (5, 12, 20)]
    alone = [reference(engine, engine.chat_prompt(m), temperature=0.8, seed=k, max_tokens=8)[0]
             for k, m in enumerate(prompts)]
    got = [None] * 3

    def ask(k):
        out = client.chat.completions.create(model="tiny", messages=prompts[k], temperature=0.8, seed=k,
                                             max_tokens=8, stream=k == 1)
        got[k] = "".join(c.choices[0].delta.content or "" for c in out) if k == 1 else out.choices[0].message.content

    try:
        threads = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        server.shutdown()
        server.server_close()
        worker.close()
    assert got == alone and all(alone)


def test_the_api_key_is_required_when_set(engine):
    server, worker = start(engine, api_key="sesame")
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=base, api_key="sesame", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices
    finally:
        server.shutdown()
        server.server_close()
        worker.close()
