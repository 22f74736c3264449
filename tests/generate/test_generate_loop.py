"""generate / generate_step: stopping rules, streamed text, timing, context limits.

A scripted runner makes the token sequence a given one, so each rule is checked against a
hand-written expectation; the real models are checked against HF in tests/models.
"""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import byte_tokenizer

from anelm.generate.generate import TextStream, generate, generate_step
from anelm.generate.runner import Runner
from anelm.models.base import init_weights
from anelm.models.config import LlamaConfig
from anelm.models.errors import ContextError, InputError
from anelm.models.llama import Model, expected_shapes
from anelm.models.tokenizer import load_tokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
EOS = 256


class ScriptRunner:
    """Greedy decoding of this runner yields `script`, one token per step."""

    device = "cpu"

    def __init__(self, script, vocab=257, capacity=64):
        self.script, self.vocab, self.capacity = list(script), vocab, capacity
        self.config = SimpleNamespace(eos_ids=(EOS,), max_position_embeddings=capacity)
        self.decoded = 0

    def new_cache(self):
        return SimpleNamespace(length=0, capacity=self.capacity)

    def _logits(self, step):
        out = np.zeros(self.vocab, np.float32)
        out[self.script[step]] = 5.0
        return out

    def prefill(self, ids, cache, last_only=False):
        cache.length += len(ids)
        self.start = cache.length
        return self._logits(0)[None]

    def decode(self, token, cache):
        cache.length += 1
        self.decoded += 1
        return self._logits(cache.length - self.start)


@pytest.fixture(scope="module")
def bytes_tok():
    return byte_tokenizer(EOS)


def run(tok, text, **kw):
    ids = tok.encode(text)
    pieces = []
    res = generate(ScriptRunner(ids + [EOS] * 40), tok, [65], on_text=pieces.append, **kw)
    return res, pieces


def test_multibyte_characters_stream_whole(bytes_tok):
    text = "héllo 😀 日本 👨‍👩‍👧!"
    res, pieces = run(bytes_tok, text)
    assert len(bytes_tok.encode(text)) > len(text)  # characters really span several tokens
    assert (res.text, "".join(pieces), res.finish_reason) == (text, text, "eos")
    assert all("\ufffd" not in p for p in pieces)
    assert res.ids == bytes_tok.encode(text)  # without the EOS


def test_stop_strings_cut_the_text_and_never_stream_a_partial_stop(bytes_tok):
    res, pieces = run(bytes_tok, "one two STOP three", stop=["STOP", "never"])
    assert (res.text, "".join(pieces), res.finish_reason) == ("one two ", "one two ", "stop")
    assert not any("S" in p for p in pieces)
    res, pieces = run(bytes_tok, "abc STand STOP", stop=["STOP"])  # a false start is released
    assert (res.text, "".join(pieces)) == ("abc STand ", "abc STand ")


def test_max_tokens_and_timing(bytes_tok):
    res, pieces = run(bytes_tok, "abcdefgh", max_tokens=5)
    assert (res.ids, res.text, res.finish_reason) == (bytes_tok.encode("abcde"), "abcde", "length")
    assert res.prefill_ms > 0 and res.decode_tokens_per_s > 0
    res, pieces = run(bytes_tok, "abc", max_tokens=0)
    assert (res.ids, res.text, pieces) == ([], "", [])


def test_generation_stops_when_the_context_is_full():
    runner = ScriptRunner(list(range(10, 40)), capacity=10)
    got = [t for t, _ in generate_step(runner, list(range(8)))]
    assert got == [10, 11, 12] and runner.decoded == 2  # positions 8 and 9 are the last
    with pytest.raises(ContextError, match="the prompt is 11 tokens, longer than the model's context of 10"):
        next(generate_step(runner, list(range(11))))
    with pytest.raises(InputError, match="the prompt is empty"):
        next(generate_step(runner, []))


def test_logprobs_are_normalized_and_processors_see_the_history():
    seen = []

    def proc(tokens, logits):
        seen.append(list(tokens))
        return logits

    steps = generate_step(ScriptRunner([3, 4, 5]), [1, 2], logits_processors=[proc])
    (t1, lp1), (t2, _) = next(steps), next(steps)
    assert (t1, t2) == (3, 4) and np.isclose(np.exp(lp1).sum(), 1.0, atol=1e-6)
    assert seen == [[1, 2], [1, 2, 3]]


def test_cpu_model_is_a_runner():
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16)
    model = Model(config, init_weights(expected_shapes(config)))
    assert isinstance(model, Runner)
    assert isinstance(model.new_cache().capacity, int)


def test_sentencepiece_stream_keeps_the_leading_space():
    path = SHARED / "data" / "tokenizers" / "llama2c-tokenizer-32k.bin"
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared (external fixtures) is not part of a user's clone")
    tok = load_tokenizer(path)
    prompt = tok.encode("Once upon a time")
    new = tok.encode("there was a café", add_special_tokens=False)  # "▁there▁was..."
    assert tok.decode(new) == "there was a café"  # alone, the first space is dropped
    assert TextStream(tok, prompt).text(new) == " there was a café"
    res = generate(ScriptRunner(new + [2] * 5, vocab=32000), tok, prompt)
    assert res.text == " there was a café" and res.finish_reason == "eos"


def test_a_cache_holding_the_prompts_start_is_continued():
    runner = ScriptRunner([10, 11, 12], capacity=20)
    cache = runner.new_cache()
    cache.length = 5  # an earlier turn left the first 5 prompt tokens in the cache
    prefilled = []
    prefill = runner.prefill
    runner.prefill = lambda ids, c, last_only=False: prefilled.append(list(ids)) or prefill(ids, c, last_only)
    steps = generate_step(runner, list(range(8)), cache=cache)
    assert next(steps)[0] == 10 and prefilled == [[5, 6, 7]] and cache.length == 8
    held = runner.new_cache()
    held.length = 8
    with pytest.raises(InputError, match="the cache holds 8 positions; expected fewer than the prompt's 8"):
        next(generate_step(runner, list(range(8)), cache=held))
    with pytest.raises(ContextError, match="the prompt is 21 tokens"):
        next(generate_step(runner, list(range(21)), cache=cache))


def test_ctrl_c_ends_an_interruptible_generation_with_what_it_has(bytes_tok):
    """Chat's Ctrl-C: the reply stops, the text so far and its ids come back, and the
    cache holds exactly the positions that ran; without `interruptible` the interrupt goes on."""
    script = bytes_tok.encode("abcdefgh") + [EOS] * 5

    def stop_after(n, pieces):
        def on_text(piece):
            pieces.append(piece)
            if len(pieces) == n:
                raise KeyboardInterrupt
        return on_text

    runner, pieces = ScriptRunner(script), []
    cache = runner.new_cache()
    res = generate(runner, bytes_tok, [65], on_text=stop_after(3, pieces), cache=cache, interruptible=True)
    assert (res.text, "".join(pieces), res.finish_reason) == ("abc", "abc", "interrupted")
    assert res.ids == bytes_tok.encode("abc") and cache.length == 1 + 2  # "c" was never run
    with pytest.raises(KeyboardInterrupt):
        generate(ScriptRunner(script), bytes_tok, [65], on_text=stop_after(3, []))
