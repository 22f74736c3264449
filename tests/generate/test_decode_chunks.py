"""Several tokens in one decode pass pair (generate/device_passes.py, kernels/decode.py): the
tokens a prefill bucket does not hold, and a resumed conversation's new ones, run in chunks of up
to the decode program's 16 columns, each chunk two passes of the same program (the first's keys
into the cache, then each column seeing the tokens before it). Against one decode step per token
(the same programs) and HF float32, on a tiny Llama (GQA) and on Mistral (a window on every layer,
a ring cache: its chunks are as wide as the ring allows)."""

import numpy as np
import pytest

import hf_tiny
from helpers import rel_err

from anelm.chip.profile import STRICT
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.generate.device_passes import chunk_width
from anelm.generate.device_plan import SizePlan, decode_groups, decode_seconds
from anelm.generate.pipeline import build_runner
from anelm.models.loading import load_model

LOGITS_TOL = 3e-2  # docs/testing.md: logits of a whole tiny model against HF float32
KV_TOL = 1e-2  # two fp16 device paths of the same arithmetic (test_generate_device.py)


def test_groups_take_chunks_where_two_passes_cost_less_than_the_steps():
    plan = SizePlan((16,), (64,), 2, 64)
    dear = lambda kind, size: {"decode": 1.0, "chunk": 2.0}[kind]  # noqa: E731  (a chunk pays from 5 tokens)
    assert decode_groups(10, 40, plan, dear, 16) == [16, 14]
    assert decode_groups(10, 30, plan, dear, 16) == [16, 1, 1, 1, 1]  # 4 tokens: 4 steps beat 2 passes of 2.0
    assert decode_groups(10, 40, plan, dear, 1) == [1] * 30  # one token a pass (a ring of its window)
    assert decode_groups(10, 40, plan, lambda kind, size: 1.0 if kind == "decode" else 9.0, 16) == [1] * 30
    assert decode_seconds(10, 40, plan, dear, 16) == 2 * 2.0 + 2 * 2.0
    assert decode_seconds(10, 40, plan, dear) == 30 * 1.0


def test_chunk_width_keeps_every_window_in_its_ring():
    assert chunk_width(16, [None, None], [None, None]) == 16
    assert chunk_width(16, [8, None], [16, None]) == 9  # the first token's 7 keys before it, and 9 new
    assert chunk_width(16, [512], [512]) == 1  # a ring of exactly its window: a token at a time


@pytest.fixture(scope="module", params=["llama-gqa", "mistral"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chunks") / request.param
    hf = hf_tiny.make_hf(request.param, folder, seed=3)
    config, weights, _ = load_model(folder)
    return hf, build_runner(config, weights, Emulator(STRICT), max_context=64)


def test_chunks_give_the_steps_logits_and_cache(tiny):
    hf, runner = tiny
    ids = np.random.default_rng(11).integers(0, 96, 44).tolist()
    ref = hf_tiny.hf_logits(hf, ids)
    wide, chunk = runner.chunk, runner.chunk
    assert chunk == (16 if runner.rings[0] is None else 9)  # Mistral's window 8 in a ring of 16
    runner.pass_seconds = lambda kind, size: {"prefill": size * 1e-3, "decode": 1.0, "chunk": 1.0}[kind]
    caches, logits = [], []
    before = None
    for runner.chunk in (1, wide):  # one token a pass, then chunks (the same programs)
        cache = runner.new_cache()
        first = runner.prefill(ids[:6], cache)  # a held prefix: the rest runs from position 6
        rest = runner.prefill(ids[6:], cache)
        caches.append(cache)
        logits.append(np.concatenate([first, rest]))
        before = compile_count() if before is None else before
    runner.chunk = wide
    assert compile_count() == before  # the chunks ran the decode programs the steps compiled
    assert rel_err(logits[1], logits[0]) <= KV_TOL
    assert rel_err(logits[1], ref) <= LOGITS_TOL and rel_err(logits[0], ref) <= LOGITS_TOL
    for a, b in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):
        assert rel_err(a.astype(np.float32), b.astype(np.float32)) <= KV_TOL
    nxt = runner.decode(5, caches[1])  # decoding goes on from a chunked cache
    assert rel_err(nxt, hf_tiny.hf_logits(hf, ids + [5])[-1]) <= LOGITS_TOL
