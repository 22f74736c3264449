"""stream_generate: Deltas that join to generate()'s text, the stopping rules and finish reasons,
the model's logprobs, a consumer that stops early, the caller's logit processors.

A noisy scripted runner (its logits favour the bytes of a text, with noise fixed by the position
and the previous token) makes seeded sampling stray from the text now and then; the logprobs and
the cache are checked on a tiny HF model run by the CPU reference.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import byte_tokenizer

from anelm.generate.generate import OPENAI_FINISH_REASONS, Delta, generate, log_softmax, stream_generate
from anelm.generate.sampling import SamplingError, SamplingOptions, make_sampler

EOS = 256
TEXT = "héllo 😀 wörld, 日本語 END then more"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer(EOS)


class NoisyRunner:
    """At position p the likeliest next token is script[p + 1] (by `lead` nats over the rest of a few
    ASCII candidates, the other tokens far below), with noise that p and the previous token fix."""

    device = "cpu"

    def __init__(self, script, strays, lead=6.0, capacity=128, vocab=257):
        self.script, self.strays, self.lead, self.capacity = list(script), list(strays), lead, capacity
        self.config = SimpleNamespace(eos_ids=(EOS,), max_position_embeddings=capacity, vocab_size=vocab)
        self.vocab = vocab

    def new_cache(self):
        return SimpleNamespace(length=0, capacity=self.capacity)

    def _logits(self, pos, last):
        rng = np.random.default_rng(pos * 1000 + int(last))
        out = np.full(self.vocab, -20.0, np.float32)
        out[self.strays] = rng.standard_normal(len(self.strays))
        out[self.script[min(pos + 1, len(self.script) - 1)]] = self.lead + rng.standard_normal()
        return out

    def prefill(self, ids, cache, last_only=False):
        start, cache.length = cache.length, cache.length + len(ids)
        rows = [self._logits(start + i, t) for i, t in enumerate(ids)]
        return np.stack(rows[-1:] if last_only else rows)

    def decode(self, token, cache):
        cache.length += 1
        return self._logits(cache.length - 1, token)


def scripted(tok, text=TEXT, **kw):
    """A runner that, after a one-token prompt, says `text` then EOS (greedily)."""
    return NoisyRunner([0] + tok.encode(text) + [EOS] * 8, tok.encode("abcdefgh xyz"), **kw)


def check_against_generate(runner, tok, prompt, options):
    deltas = list(stream_generate(runner, tok, prompt, options))
    res = generate(runner, tok, prompt, max_tokens=options.max_tokens, sampler=options.sampler(),
                   logits_processors=options.processors(len(prompt)), stop=options.stop)
    *steps, last = deltas
    assert all(d.finish_reason is None and d.token is not None for d in steps)
    assert last.token is None and last.finish_reason == res.finish_reason
    assert "".join(d.text for d in deltas) == res.text and [d.token for d in steps] == res.ids
    return deltas, res


@pytest.mark.parametrize("stop, text, reason", [
    ((), TEXT, "eos"),
    (("日本語 E", "never"), "héllo 😀 wörld, ", "stop"),
    (("ö",), "héllo 😀 w", "stop"),  # a two-byte stop string
    (("llo 😀 wör",), "hé", "stop"),
])
def test_greedy_deltas_join_to_generates_text(tok, stop, text, reason):
    deltas, res = check_against_generate(scripted(tok), tok, [0], SamplingOptions(temperature=0, stop=list(stop)))
    assert (res.text, res.finish_reason) == (text, reason)
    assert all("\ufffd" not in d.text for d in deltas)  # no piece splits a character
    for s in stop:  # nothing of the stop string that was found shows before it completes
        assert not any(s[0] in d.text for d in deltas) or s[0] in text


def test_seeded_sampling_streams_as_generate_and_alike_per_request(tok):
    runner = scripted(tok, lead=2.5)  # the text, with strays
    stop = ["ö", "日本", " x"]
    greedy_ids = generate(runner, tok, [0], max_tokens=40, stop=stop).ids
    reasons, strayed = set(), 0
    for seed in range(8):
        options = SamplingOptions(temperature=1.0, top_p=0.95, seed=seed, stop=stop, max_tokens=40)
        deltas, res = check_against_generate(runner, tok, [0], options)
        assert list(stream_generate(runner, tok, [0], options)) == deltas  # the seed fixes the stream
        seeded = generate(runner, tok, [0], max_tokens=40, sampler=make_sampler(1.0, 0, 0.95, seed), stop=stop)
        assert (seeded.ids, seeded.text) == (res.ids, res.text)
        reasons.add(res.finish_reason)
        strayed += res.ids != greedy_ids
    assert "stop" in reasons and strayed >= 4


def test_finish_reasons_and_their_openai_names(tok):
    def last(runner, **kw):
        return list(stream_generate(runner, tok, [0], SamplingOptions(temperature=0, **kw)))[-1]

    assert last(scripted(tok), max_tokens=3).finish_reason == "length"
    assert last(scripted(tok)).finish_reason == "eos"
    assert last(scripted(tok), stop=["END"]).finish_reason == "stop"
    assert last(scripted(tok, capacity=10)).finish_reason == "context"  # max_tokens None: up to the context
    only = list(stream_generate(scripted(tok), tok, [0], SamplingOptions(max_tokens=0)))
    assert only == [Delta("", None, None, None, "length")]
    assert {k: OPENAI_FINISH_REASONS[k] for k in ("eos", "stop", "length", "context")} == {
        "eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def test_a_held_back_stop_start_and_a_partial_character_come_out_at_the_end(tok):
    runner = scripted(tok, text="ab EN")  # stops at EOS while "EN" may still become "END"
    deltas = list(stream_generate(runner, tok, [0], SamplingOptions(temperature=0, stop=["END"])))
    assert "".join(d.text for d in deltas[:-1]) == "ab " and deltas[-1].text == "EN"
    options = SamplingOptions(temperature=0, max_tokens=5)
    deltas = list(stream_generate(scripted(tok, text="ab 😀"), tok, [0], options))
    assert [d.text for d in deltas] == ["a", "b", " ", "", "", "\ufffd"]  # 2 of the emoji's 4 bytes, at the end


def test_interrupts_end_an_interruptible_stream_only(tok):
    stream = stream_generate(scripted(tok), tok, [0], SamplingOptions(temperature=0, stop=["ll"]), interruptible=True)
    assert [next(stream).text for _ in range(3)] == ["h", "", "é"]  # "é" is two bytes
    next(stream)  # "l" is held: it may start "ll"
    end = stream.throw(KeyboardInterrupt())
    assert (end.text, end.token, end.finish_reason) == ("l", None, "interrupted")
    stream = stream_generate(scripted(tok), tok, [0], SamplingOptions(temperature=0))
    next(stream)
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt())


def test_options_are_checked_before_any_work(tok):
    runner = scripted(tok)
    runner.prefill = None  # any work would fail otherwise
    with pytest.raises(SamplingError, match="top_logprobs must be an integer in"):
        stream_generate(runner, tok, [0], SamplingOptions(top_logprobs=30))
    with pytest.raises(SamplingError, match=r"logit_bias token ids must be integers in \[0, 257\), got 300"):
        stream_generate(runner, tok, [0], SamplingOptions(logit_bias={300: 1.0}))


def test_a_callers_processor_runs_last_and_follows_each_token(tok):
    allowed = tok.encode("abcde")

    class OnlyAtoE:
        def __init__(self):
            self.advanced, self.seen_bias = [], []

        def __call__(self, tokens, logits):
            self.seen_bias.append(float(logits[allowed[1]]))
            out = np.full_like(logits, -np.inf)
            out[allowed] = logits[allowed]
            return out

        def advance(self, token):
            self.advanced.append(token)

    proc = OnlyAtoE()
    options = SamplingOptions(temperature=0, max_tokens=4, logit_bias={allowed[1]: 50.0})
    deltas = list(stream_generate(scripted(tok), tok, [0], options, logits_processors=[proc]))
    assert [d.token for d in deltas[:-1]] == [allowed[1]] * 4 == proc.advanced  # "b", pushed by the bias
    assert "".join(d.text for d in deltas) == "bbbb" and min(proc.seen_bias) > 40  # the bias came first


# --- on a tiny HF model, run by the CPU reference ---------------------------------------------

@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    hf_tiny = pytest.importorskip("hf_tiny")
    from anelm.models.loading import build_model, load_model

    d = tmp_path_factory.mktemp("stream") / "llama"
    hf_tiny.make_word_model(d)
    config, weights, tokenizer = load_model(d)
    return build_model(config, weights), tokenizer


PROMPT = [5, 9, 22, 40]


def test_logprobs_are_the_models_log_softmax(word_model):
    model, tokenizer = word_model
    # the penalty and the bias change what is sampled, not the logprobs reported (OpenAI's)
    options = SamplingOptions(temperature=0, max_tokens=6, logprobs=True, top_logprobs=5,
                              repetition_penalty=1.3, logit_bias={7: 2.0})
    deltas = list(stream_generate(model, tokenizer, PROMPT, options, eos_ids=()))
    ids = [d.token for d in deltas[:-1]]
    assert len(ids) == 6 and deltas[-1].logprob is None and deltas[-1].top_logprobs is None
    logits = model.prefill(PROMPT + ids[:-1], model.new_cache())[len(PROMPT) - 1:]  # row i chose ids[i]
    for d, row in zip(deltas, logits):
        ref = log_softmax(row)
        assert np.isclose(d.logprob, ref[d.token], atol=1e-4)
        top_ids, top_values = zip(*d.top_logprobs)
        assert list(top_ids) == np.argsort(-ref, kind="stable")[:5].tolist()
        assert np.allclose(top_values, ref[list(top_ids)], atol=1e-4) and list(top_values) == sorted(top_values)[::-1]
    plain = list(stream_generate(model, tokenizer, PROMPT, SamplingOptions(temperature=0, max_tokens=2)))
    assert all(d.logprob is None and d.top_logprobs is None for d in plain)
    bare = list(stream_generate(model, tokenizer, PROMPT, SamplingOptions(temperature=0, max_tokens=2, logprobs=True)))
    assert bare[0].top_logprobs == [] and bare[0].logprob is not None


def test_a_consumer_that_stops_early_leaves_a_usable_cache(word_model):
    model, tokenizer = word_model
    cache = model.new_cache()
    stream = stream_generate(model, tokenizer, PROMPT, SamplingOptions(temperature=0, max_tokens=20), cache=cache,
                             eos_ids=())
    got = [next(stream).token for _ in range(3)]
    stream.close()  # a client that disconnects
    assert cache.length == len(PROMPT) + 2  # the third token was never run
    follow = PROMPT + got + [11]
    with_cache = generate(model, tokenizer, follow, max_tokens=5, cache=cache, eos_ids=())
    fresh = generate(model, tokenizer, follow, max_tokens=5, eos_ids=())
    assert with_cache.ids == fresh.ids and cache.length == len(follow) + 4
