"""SamplingOptions: each field's range check, and its sampler and processors against HF
transformers' logits processors (min-p, top-k, top-p, temperature, repetition penalty, bias)
and OpenAI's documented presence/frequency penalties."""

import math

import numpy as np
import pytest

from anelm.generate.sampling import SamplingError, SamplingOptions, check_sampling, greedy, sampling_probs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,  # noqa: E402
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

V = 64


def hf_probs(logits, *warpers):
    scores = torch.tensor(logits[None], dtype=torch.float64)
    for w in warpers:
        scores = w(torch.zeros((1, 1), dtype=torch.long), scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


def random_logits(seed, n=V):
    return np.random.default_rng(seed).standard_normal(n) * 2.0


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", -1, "max_tokens must be an integer >= 0, got -1"),
    ("max_tokens", 2.5, "max_tokens must be an integer >= 0, got 2.5"),
    ("temperature", -0.1, r"temperature must be >= 0 \(0 is greedy\), got -0.1"),
    ("temperature", math.inf, "temperature must be >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\] \(1 is off\), got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, r"top_k must be an integer >= 0 \(0 is off\), got -2"),
    ("top_k", 3.0, "top_k must be an integer >= 0"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\] \(0 is off\), got 1.5"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
    ("seed", 1.5, "seed must be an integer, got 1.5"),
    ("stop", "END", "stop must be a list of strings, got END"),
    ("stop", ["a", 3], "stop must be a list of strings"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\] \(0 is off\), got 2.5"),
    ("frequency_penalty", -3, r"frequency_penalty must be in \[-2, 2\] \(0 is off\), got -3"),
    ("repetition_penalty", 0, r"repetition_penalty must be > 0 \(1 is off\), got 0"),
    ("logit_bias", [1, 2], "logit_bias must be a map of token ids to biases"),
    ("logit_bias", {5: 101}, r"logit_bias\[5\] must be in \[-100, 100\], got 101"),
    ("logit_bias", {5: -100.5}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1}, "logit_bias token ids must be integers >= 0, got -1"),
    ("logit_bias", {"5": 1}, "logit_bias token ids must be integers >= 0, got 5"),
    ("logprobs", 1, "logprobs must be true or false, got 1"),
    ("top_logprobs", 21, r"top_logprobs must be an integer in \[0, 20\], got 21"),
    ("top_logprobs", -1, r"top_logprobs must be an integer in \[0, 20\]"),
])
def test_each_field_is_checked_with_one_line_naming_it(field, value, message):
    with pytest.raises(SamplingError, match=message) as e:
        SamplingOptions(**{field: value}).check()
    assert "\n" not in str(e.value)


def test_defaults_are_openais_and_pass():
    o = SamplingOptions()
    assert o.check() is o
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.min_p, o.seed) == (None, 1.0, 1.0, 0, 0.0, None)
    assert (o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (o.stop, o.logit_bias, o.logprobs, o.top_logprobs) == ((), {}, False, 0)
    edge = SamplingOptions(max_tokens=0, temperature=0, top_p=1, min_p=1, seed=-5, stop=["a"], presence_penalty=-2,
                           frequency_penalty=2, logit_bias={0: -100, 9: 100}, logprobs=True, top_logprobs=20)
    assert edge.check(vocab_size=10) is edge


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    with pytest.raises(SamplingError, match=r"logit_bias token ids must be integers in \[0, 10\), got 10"):
        SamplingOptions(logit_bias={10: 1.0}).check(vocab_size=10)


def test_the_flags_keep_their_spelling():
    with pytest.raises(SamplingError, match="top-k must be an integer >= 0"):
        check_sampling(top_k=-1)
    with pytest.raises(SamplingError, match="repetition-penalty must be > 0"):
        check_sampling(repetition_penalty=0)


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_against_hf(min_p):
    logits = random_logits(1)
    ours = sampling_probs(logits, 1.0, min_p=min_p)
    assert np.allclose(ours, hf_probs(logits, MinPLogitsWarper(min_p)), atol=1e-12)
    assert 0 < np.count_nonzero(ours) < V


@pytest.mark.parametrize("seed, temperature, top_k, top_p, min_p", [
    (2, 0.7, 0, 1.0, 0.0), (3, 1.0, 10, 1.0, 0.0), (4, 1.0, 0, 0.8, 0.0), (5, 1.3, 20, 0.9, 0.1),
    (6, 0.5, 5, 0.95, 0.3), (7, 2.0, 0, 0.6, 0.05)])
def test_the_sampling_chain_against_hf_in_its_order(seed, temperature, top_k, top_p, min_p):
    """HF's warpers in the order of its `_get_logits_processor`: temperature, top-k, top-p, min-p."""
    logits = random_logits(seed)
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    ours = sampling_probs(logits, temperature, top_k, top_p, min_p)
    assert np.allclose(ours, hf_probs(logits, *warpers), atol=1e-9)


def test_repetition_penalty_counts_the_prompt_too_as_hf():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal(V).astype(np.float32)
    tokens = rng.integers(0, V, 30).tolist()
    (proc,) = SamplingOptions(repetition_penalty=1.4).processors(prompt_length=20)
    ref = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([tokens]), torch.tensor(logits[None]))[0].numpy()
    assert np.allclose(proc(tokens, logits), ref, rtol=1e-6)


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = np.arange(8, dtype=np.float32)
    tokens = [1, 1, 2] + [3, 3, 3, 4]  # a prompt of 3, then 3 three times and 4 once
    (proc,) = SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25).processors(prompt_length=3)
    expect = logits.copy()
    expect[3] -= 0.5 + 0.25 * 3
    expect[4] -= 0.5 + 0.25 * 1
    assert np.allclose(proc(tokens, logits), expect) and np.array_equal(logits, np.arange(8))
    assert proc(tokens[:3], logits) is logits  # nothing generated yet: nothing to penalize
    negative = SamplingOptions(presence_penalty=-1.0).processors(3)[0](tokens, logits)
    assert negative[3] == logits[3] + 1 and negative[1] == logits[1]  # a negative penalty encourages


def test_logit_bias_against_hf_sequence_bias():
    logits = random_logits(9).astype(np.float32)
    bias = {3: 5.0, 17: -100.0, 40: 0.5}
    (proc,) = SamplingOptions(logit_bias=bias).processors(prompt_length=0)
    ref = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})(
        torch.tensor([[1, 2]]), torch.tensor(logits[None]))[0].numpy()
    assert np.allclose(proc([1, 2], logits), ref)


def test_processors_in_hf_order_and_none_when_off():
    assert SamplingOptions().processors(5) == []
    procs = SamplingOptions(repetition_penalty=2.0, presence_penalty=1.0, logit_bias={0: 3.0}).processors(1)
    logits = np.array([2.0, 1.0, 0.0], np.float32)
    for p in procs:
        logits = p([0, 0], logits)
    # repetition first (2 / 2 = 1), the presence penalty on the generated 0 (1 - 1), then the bias (+3)
    assert np.allclose(logits, [3.0, 1.0, 0.0])


def test_a_seeded_sampler_draws_alike_for_each_request():
    logits = random_logits(10)
    opts = SamplingOptions(temperature=1.0, top_p=0.9, min_p=0.05, seed=42)
    draws = [[s(logits) for _ in range(40)] for s in (opts.sampler(), opts.sampler())]
    assert draws[0] == draws[1] and len(set(draws[0])) > 3
    other = SamplingOptions(temperature=1.0, top_p=0.9, min_p=0.05, seed=43).sampler()
    assert [other(logits) for _ in range(40)] != draws[0]
    assert SamplingOptions(temperature=0).sampler() is greedy


def test_min_p_samples_only_what_it_keeps():
    logits = np.log(np.array([0.5, 0.3, 0.12, 0.05, 0.03]))
    sample = SamplingOptions(temperature=1.0, min_p=0.2, seed=0).sampler()
    drawn = {sample(logits) for _ in range(500)}
    assert drawn == {0, 1, 2}  # 0.05 and 0.03 fall below 0.2 · 0.5
