"""`anelm serve` on the real SmolLM2 (Q4_1 GGUF, ../shared) on the emulator, as a user starts it
(a subprocess on a loopback port) and as apps reach it (the official `openai` client).

Checked: the start line; chat at temperature 0 answers the capital of France
with Paris, and the streamed deltas join to the same text; a completion at temperature 0 is
`anelm generate --temperature 0`'s text for the same prompt and max_tokens; a json_schema
response parses and follows the schema; the second turn of a conversation with a long system
prompt reaches its first token in under half the first turn's time (its prefix is reused).
"""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

CONTEXT = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm_gguf, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    env = {**os.environ, "ANELM_CACHE_DIR": os.environ.get("ANELM_CACHE_DIR", str(log.parent / "cache"))}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "anelm", "serve", "--model", str(smollm_gguf), "--device",
                                 "emulator", "--max-context", str(CONTEXT), "--port", str(port)],
                                stderr=err, stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 600  # a cold start builds every program of the served context
        while "serving" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log.read_text()
        assert proc.poll() is None, text[-3000:]
        line = next(x for x in text.splitlines() if "serving" in x)
        yield proc, port, line, smollm_gguf
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[1]}/v1", api_key="none", max_retries=0, timeout=300)


MODEL = "smollm2-135m-instruct-q4_1.gguf"


def test_it_says_where_it_serves(server):
    _, port, line, _ = server
    assert line == f"anelm: serving {MODEL} on http://127.0.0.1:{port}"


def test_chat_answers_paris_whole_and_streamed(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_a_completion_is_anelm_generate_at_temperature_0(client, server):
    prompt = "The three primary colors are"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    run = subprocess.run([sys.executable, "-m", "anelm", "generate", "--model", str(server[3]), "--device", "emulator",
                          "--prompt", prompt, "--temperature", "0", "--max-tokens", "16", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert r.choices[0].text == json.loads(run.stdout)["text"]


def test_json_schema_output_follows_the_schema(client):
    # bounded fields: a 135M model left to write an integer repeats a digit to max_tokens
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "enum": ["France", "Spain", "Italy"]},
        "is_capital": {"type": "boolean"}}, "required": ["city", "country", "is_capital"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"city", "country", "is_capital"} and out["country"] in ("France", "Spain", "Italy")
    assert isinstance(out["city"], str) and len(out["city"]) <= 24 and isinstance(out["is_capital"], bool)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content


def first_token_s(client, messages) -> tuple[float, str]:
    t0, first, text = time.perf_counter(), None, ""
    for c in client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True):
        if c.choices and c.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += c.choices[0].delta.content
    return first, text


def test_the_second_turn_reuses_the_first_turns_cache(client):
    system = " ".join(re.findall(r"\w+", __doc__))[:1200]  # ~250 tokens of system prompt
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
    first, reply = first_token_s(client, turn)
    second, _ = first_token_s(client, turn + [{"role": "assistant", "content": reply},
                                               {"role": "user", "content": "And another?"}])
    print(f"time to first token: first turn {first:.3f} s, second {second:.3f} s")
    assert second < 0.5 * first, (first, second)
