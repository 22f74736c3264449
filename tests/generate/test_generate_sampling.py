"""Samplers and logit processors against hand-computed distributions and HF's processors."""

import math

import numpy as np
import pytest

from anelm.generate.sampling import (SamplingError, greedy, make_logits_processors, make_sampler,
                                     repetition_penalty_processor, sampling_probs)


def softmax(xs):
    e = [math.exp(x) for x in xs]
    return [v / sum(e) for v in e]


def test_greedy_takes_the_first_maximum():
    assert greedy(np.array([0.0, 3.0, 1.0, 3.0])) == 1
    assert make_sampler(temperature=0) is greedy


def test_temperature_and_top_k_by_hand():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0])
    expect = softmax([4.0, 2.0, 1.0]) + [0.0, 0.0]  # T = 0.5 doubles the logits; k = 3 keeps three
    assert np.allclose(sampling_probs(logits, 0.5, top_k=3), expect, atol=1e-12)
    assert np.allclose(sampling_probs(logits, 2.0), softmax([1.0, 0.5, 0.25, 0.0, -0.5]), atol=1e-12)
    tied = sampling_probs(np.array([1.0, 1.0, 1.0, 0.0]), 1.0, top_k=2)  # ties with the k-th stay (as HF)
    assert np.allclose(tied, [1 / 3, 1 / 3, 1 / 3, 0.0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.1, 0.5, 0.15, 0.25]))
    assert np.allclose(sampling_probs(logits, 1.0, top_p=0.74), [0, 2 / 3, 0, 1 / 3])
    assert np.allclose(sampling_probs(logits, 1.0, top_p=0.76), [0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9])
    assert np.allclose(sampling_probs(logits, 1.0, top_p=0.3), [0, 1, 0, 0])  # at least one token
    both = sampling_probs(logits, 1.0, top_k=3, top_p=0.9)  # top-k first: {0.5, .25, .15} renormalized
    assert np.allclose(both, [0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9])


def test_samples_follow_the_distribution_and_the_seed():
    logits = np.log(np.array([0.1, 0.5, 0.15, 0.25]))
    sample = make_sampler(temperature=1.0, top_p=0.76, seed=7)
    n = 5000
    counts = np.bincount([sample(logits) for _ in range(n)], minlength=4)
    p = np.array([0, 0.5, 0.15, 0.25]) / 0.9
    assert counts[0] == 0
    assert np.all(np.abs(counts / n - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-9)
    draws = lambda seed: [s(logits) for s in [make_sampler(1.0, seed=seed)] for _ in range(50)]  # noqa: E731
    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_repetition_penalty_by_hand_and_against_hf():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    got = repetition_penalty_processor(2.0)([0, 1, 1], logits)
    assert np.allclose(got, [1.0, -4.0, 1.0, 0.5])
    assert np.array_equal(logits, [2.0, -2.0, 1.0, 0.5])  # the input is not modified
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    seen = rng.integers(0, 50, 20)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(seen[None]), torch.tensor(logits[None]))[0].numpy()
    (proc,) = make_logits_processors(1.3)
    assert np.allclose(proc(seen.tolist(), logits), ref, rtol=1e-6)
    assert make_logits_processors(1.0) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be >= 0 .0 is greedy., got -0.5"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_k=-1), "top-k must be an integer >= 0 .0 is off., got -1"),
    (dict(top_p=0.0), r"top-p must be in \(0, 1\] .1 is off., got 0.0"),
    (dict(top_p=1.5), r"top-p must be in \(0, 1\]"),
])
def test_bad_values_are_one_line_usage_errors(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        make_sampler(**kwargs)


def test_bad_penalty():
    with pytest.raises(SamplingError, match=r"repetition-penalty must be > 0 .1 is off., got 0"):
        make_logits_processors(0)
