"""A runner that takes its weights (`consume=True`, what the CLI does): each layer's float32
matrices leave the caller's dict once they are fp16, so loading and building never hold a
model twice; the programs and the logits stay those of a runner that copies. And a load
releases each tensor read from a file map as soon as its float32 copy exists."""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny

from anelm.chip.profile import STRICT
from anelm.device.emulator import Emulator
from anelm.generate.pipeline import build_runner
from anelm.models import base
from anelm.models.loading import load_model
from anelm.models.names import layer_prefix

NOBUDGET = STRICT.replace(compile_budget=10**9)
PROMPT, TOKENS = [1, 5, 9, 22, 7], [3, 40, 11]


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))


def logits(runner) -> np.ndarray:
    cache = runner.new_cache()
    rows = [runner.prefill(PROMPT, cache, last_only=True)]
    rows += [runner.decode(t, cache)[None] for t in TOKENS]
    return np.concatenate(rows)


@pytest.mark.parametrize("kind", ["llama-rope3", "gpt2", "qwen3-tied"])
def test_a_consuming_runner_empties_the_dict_of_what_it_converted_and_runs_the_same(kind, tmp_path):
    hf_tiny.make_hf(kind, tmp_path / kind, seed=7)
    config, weights, _ = load_model(tmp_path / kind)
    kept = dict(weights)
    copying = build_runner(config, dict(weights), Emulator(NOBUDGET), max_context=32)
    given = dict(weights)
    taking = build_runner(config, given, Emulator(NOBUDGET), max_context=32, consume=True)
    prefixes = tuple(layer_prefix(config.model_type, i) for i in range(config.num_hidden_layers))
    layer_matrices = [k for k, a in kept.items() if k.startswith(prefixes) and a.ndim == 2]
    assert layer_matrices and not set(layer_matrices) & set(given)
    assert all(given[k] is taking.cpu.weights[k] for k in given)  # what is left is what the runner holds
    assert np.array_equal(logits(copying), logits(taking))
    assert all(kept[k] is weights[k] for k in kept) and len(kept) == len(weights)  # the copy left it whole


def test_check_weights_that_consumes_pops_each_tensor_and_keeps_values():
    rng = np.random.default_rng(0)
    given = {"a": rng.standard_normal((3, 4)).T, "b": np.arange(5, dtype=np.float64), "extra": np.zeros(2)}
    want = {k: np.ascontiguousarray(v, np.float32) for k, v in given.items() if k != "extra"}
    got = base.check_weights(given, {"a": (4, 3), "b": (5,)}, consume=True)
    assert set(given) == {"extra"} and all(np.array_equal(got[k], want[k]) and got[k].flags.c_contiguous
                                           for k in want)
