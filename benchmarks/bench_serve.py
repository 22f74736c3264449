"""`anelm serve` under load: time to first token and tokens per second, 1 and 4 clients, beside HF.

The real SmolLM2-135M-Instruct (Q4_1 GGUF, ../shared) is served by `anelm serve --device
emulator --max-context 512` in its own process; its start (loading, every program of the served
context built or loaded from the program store) is timed first, as a user's first run pays it.
Then the same chat requests (short questions, greedy, --tokens new tokens each, no shared
prefix beyond the template's) are sent through the official `openai` client, streamed:

- 1 client: the requests one after another;
- 4 clients: the same requests from 4 threads at once (the device serves them one at a time,
  in arrival order: a waiting client sees it as a later first token).

Per request: time to first token (request sent to the first content chunk) and decode rate
(tokens after the first over the time after the first). HF transformers (float32, the same
GGUF, greedy `generate` with a streamer stamping each token, its chat template) answers the
same requests one after another in this process, after the server's rounds, on the same
machine. Printed: medians of each, aggregate tokens per second of each run, and the ratios
(HF time / anelm time for the first token; anelm rate / HF rate for decode; above 1 is anelm
ahead).

    python benchmarks/bench_serve.py [--requests 8] [--tokens 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT.parent / "shared" / "data" / "models" / "smollm2-135m-instruct-q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Why is the sky blue?",
             "What is two plus two?", "Say hello in Spanish.", "What do bees make?",
             "Name a large animal.", "What color is grass?", "How many days are in a week?",
             "What is water made of?", "Name a planet.", "What is the opposite of hot?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int) -> tuple[subprocess.Popen, int, float]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "anelm", "serve", "--model", str(GGUF), "--device", "emulator",
                             "--max-context", "512", "--port", str(port)], stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if "serving" in line:
            break
    else:
        raise SystemExit(f"anelm serve exited with {proc.wait()}")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # drain the request log
    return proc, port, time.perf_counter() - t0


def ask(client, question: str, tokens: int) -> tuple[float, float, int]:
    """(time to first token s, decode tokens/s, tokens) of one streamed greedy chat request."""
    t0, stamps = time.perf_counter(), []
    stream = client.chat.completions.create(model=GGUF.name, messages=[{"role": "user", "content": question}],
                                            temperature=0, max_tokens=tokens, stream=True,
                                            stream_options={"include_usage": True})
    n = 0
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if c.usage is not None:
            n = c.usage.completion_tokens
    rate = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0
    return stamps[0] - t0, rate, n


def serve_rounds(port: int, questions: list[str], tokens: int, clients: int) -> tuple[list, float]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    results: list = [None] * len(questions)

    def worker(k):
        for i in range(k, len(questions), clients):
            results[i] = ask(client, questions[i], tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def hf_rounds(questions: list[str], tokens: int, threads: int) -> tuple[list, float, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    out, t0 = [], time.perf_counter()
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        streamer = TextIteratorStreamer(tok, skip_prompt=True)
        start, stamps = time.perf_counter(), []
        th = threading.Thread(target=model.generate, kwargs=dict(**ids, max_new_tokens=tokens, do_sample=False,
                                                                  streamer=streamer))
        th.start()
        for piece in streamer:
            if piece:
                stamps.append(time.perf_counter())
        th.join()
        n = len(stamps)
        rate = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else 0.0
        out.append((stamps[0] - start, rate, n))
    return out, time.perf_counter() - t0, load


def summary(name: str, results: list, wall: float) -> tuple[float, float]:
    ttft = statistics.median(r[0] for r in results)
    rate = statistics.median(r[1] for r in results)
    total = sum(r[2] for r in results)
    print(f"{name:<22} first token {ttft * 1e3:8.0f} ms   decode {rate:6.1f} tok/s   "
          f"{total} tokens in {wall:6.1f} s = {total / wall:6.1f} tok/s overall")
    return ttft, rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if not GGUF.is_file():
        raise SystemExit(f"{GGUF} is absent")
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(a.requests)]
    proc, port, started = start_server(a.threads)
    try:
        print(f"anelm serve started in {started:.1f} s (load + every program of a 512-token context)")
        serve_rounds(port, questions[:1], 4, 1)  # the first request's one-off costs, reported apart
        one = summary("anelm, 1 client", *serve_rounds(port, questions, a.tokens, 1))
        four = summary("anelm, 4 clients", *serve_rounds(port, questions, a.tokens, 4))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    results, wall, load = hf_rounds(questions, a.tokens, a.threads)
    print(f"HF transformers loaded in {load:.1f} s")
    hf = summary("HF, one after another", results, wall)
    for name, (ttft, rate) in (("1 client", one), ("4 clients", four)):
        print(f"ratio, {name}: first token HF/anelm {hf[0] / ttft:.2f}x, decode anelm/HF {rate / hf[1]:.2f}x")


if __name__ == "__main__":
    main()
