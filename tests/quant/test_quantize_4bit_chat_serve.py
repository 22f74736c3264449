"""`anelm chat` and `anelm serve` read W4 and LUT4 folders (docs/quantization.md,
docs/serving.md): a tiny random Llama and a tiny random Gemma 3, each with a word tokenizer and
a chat template, quantized to each scheme, on the emulator.

The oracle is a path that shares neither command's code: the folder read back by `load_model`,
its device runner built by hand (`build_runner`) and run greedily, prefill then one decode a
token, argmax of each step's logits, stopping at EOS. At temperature 0:
* `anelm chat`'s reply to one line is the text of those tokens from the chat template's ids;
* the server's chat completion is the same text, whole and streamed;
* the server's text completion is `anelm generate --temperature 0`'s for the same prompt, and
  both are the oracle's tokens from the completion's ids.
Exact equality: every path runs the same fp16 programs of the same folder; they differ at most
in a cache's capacity and a prefill's bucket, which move the logits by fp16 rounding (~1e-3 of
max|logit|). So the oracle holds every greedy step's top-2 margin to at least MARGIN = 1e-2 of
max|logit| (measured: 1.8e-2 at least over these 4-token replies; 2e-3 at a later step, which
is why replies stop at 4), and then equality is not luck. The source model and the two folders
answer differently (measured, Llama: the source's chat reply is w51 w4 w92 w48, W4's w51 w4 w14
w25, LUT4's w51 w59 w84 w48; Gemma 3: w32 w21 w56 w48, w32 w59 w57 w31, w79 w22 w12 w57), so a
command that read the wrong weights would fail; the oracle's programs are checked to carry
4-bit weights.
"""

import io
import json
import sys
import threading

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
import hf_tiny  # noqa: E402
import instruct_tiny  # noqa: E402

from anelm.cli.main import main  # noqa: E402
from anelm.generate.engine import load_engine  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402
from anelm.quant.command import build_folder  # noqa: E402
from anelm.serve.server import make_server  # noqa: E402
from anelm.serve.worker import DeviceWorker  # noqa: E402

CONTEXT = 64
STEPS = 4  # --max-tokens of every request (module doc)
MARGIN = 1e-2  # the least top-2 logit margin of an oracle's step, x max|logit| (module doc)
SCHEMES = ["w4", "lut4"]
# each family's tiny model: a seed whose greedy replies keep the margin and tell the source and
# the two folders apart (module doc)
SEEDS = {"llama-gqa": 21, "gemma3": 5}
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]
PROMPT = "w9 w10 w11"
CARRIES = {"w4": "data = tensor<uint4, [128, 64, 1, 1]>(BLOBFILE",  # gate and up, 4-bit
           "lut4": "indices = tensor<uint4, [128, 64, 1, 1]>(BLOBFILE"}


@pytest.fixture(scope="module", params=["llama-gqa", "gemma3"])
def folders(request, tmp_path_factory):
    """{scheme: its folder} of one tiny model of the family with a chat template."""
    d = tmp_path_factory.mktemp("q4chat") / request.param
    hf_tiny.make_word_model(d, seed=SEEDS[request.param], kind=request.param)
    instruct_tiny.add_chat_template(d)
    config, weights, tok = load_model(d)
    calib = np.random.default_rng(3).integers(3, 96, 64).tolist()  # LUT4's input moments
    return {s: build_folder(d.parent / s, config, weights, tok, s, calib, 32, False)[0] for s in SCHEMES}


def greedy(folder, ids):
    """The oracle (module doc): (tokens, their words) of the folder's device runner, greedy from
    `ids`. Texts are compared word by word: how a reply's first word is spaced is the streaming
    detokenizer's business (a chat line starts at the word, a completion with its space)."""
    config, weights, tok = load_model(folder)
    runner = build_runner(config, weights, "emulator", max_context=CONTEXT)
    cache, tokens = runner.new_cache(), []
    logits = runner.prefill(list(ids), cache, last_only=True)[-1]
    while len(tokens) < STEPS and int(np.argmax(logits)) not in config.eos_ids:
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] >= MARGIN * np.abs(logits).max(), (tokens, top2)  # not a near-tie
        tokens.append(int(np.argmax(logits)))
        logits = runner.decode(tokens[-1], cache)
    art = next(k for key, k in runner.kernels.items() if key[0] == "prefill").artifact
    assert CARRIES[folder.name] in art.mil_text
    return tokens, [hf_tiny.WORDS[t] for t in tokens]


@pytest.fixture(scope="module")
def served(folders):
    """{scheme: (engine, port)}: the server `anelm serve` starts, in process on loopback."""
    out, stops = {}, []
    for scheme, folder in folders.items():
        engine = load_engine(folder, device="emulator", max_context=CONTEXT, model_id=scheme, notice=lambda m: None)
        worker = DeviceWorker(engine)
        server = make_server(worker, engine.model_id, "127.0.0.1", 0, None)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        out[scheme] = engine, server.server_address[1]
        stops.append((server, worker))
    yield out
    for server, worker in stops:
        server.shutdown()
        server.server_close()
        worker.close()


def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chat_at_temperature_0_is_the_runners_greedy_reply(folders, scheme, capsys, monkeypatch):
    folder = folders[scheme]
    tok = load_model(folder)[2]
    assert tok.chat_format() == "template"  # the folder kept the source's chat template
    tokens, words = greedy(folder, tok.apply_chat_template(MESSAGES))
    assert len(tokens) >= 3, tokens  # a reply long enough to tell paths apart
    monkeypatch.setattr(sys, "stdin", io.StringIO(MESSAGES[0]["content"] + "\n"))
    rc = main(["chat", "--model", str(folder), "--temperature", "0", "--max-tokens", str(STEPS),
               "--device", "emulator"])
    out, err = capsys.readouterr()
    assert rc == 0 and "template format" in err, err
    assert out.count("\n") == 1 and out.split() == words, (out, words)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_served_chat_at_temperature_0_is_the_runners_greedy_reply(folders, served, scheme):
    engine, port = served[scheme]
    tokens, words = greedy(folders[scheme], engine.chat_prompt(MESSAGES))
    r = client(port).chat.completions.create(model=scheme, messages=MESSAGES, temperature=0, max_tokens=STEPS)
    assert r.choices[0].message.content.split() == words and r.usage.completion_tokens == len(tokens)
    chunks = client(port).chat.completions.create(model=scheme, messages=MESSAGES, temperature=0, max_tokens=STEPS,
                                                  stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize("scheme", SCHEMES)
def test_served_completion_is_anelm_generate_at_temperature_0(folders, served, scheme, capsys):
    engine, port = served[scheme]
    tokens, words = greedy(folders[scheme], engine.completion_prompt(PROMPT))
    assert len(tokens) >= 3, tokens
    rc = main(["generate", "--model", str(folders[scheme]), "--prompt", PROMPT, "--temperature", "0",
               "--max-tokens", str(STEPS), "--device", "emulator", "--json"])
    generated = json.loads(capsys.readouterr().out)
    assert rc == 0 and generated["ids"] == tokens and generated["text"].split() == words
    r = client(port).completions.create(model=scheme, prompt=PROMPT, temperature=0, max_tokens=STEPS)
    assert r.choices[0].text == generated["text"] and r.usage.completion_tokens == len(tokens)
