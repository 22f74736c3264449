"""The prefill policy (device_plan.choose_bucket, DeviceRunner.prefill_bucket): a first prompt
runs the bucket predicted fastest, a smaller one followed by decode steps when that is cheaper;
free prefill slots take the ladder's sizes; a server's slots are chosen by the mean first-token
time (serving_buckets). Both paths give the same logits within a whole tiny model's 3e-2 (docs/testing.md)."""

import numpy as np
import pytest

import hf_tiny
from helpers import rel_err

from anelm.chip.profile import STRICT
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.device.emulator.cost import emulated_seconds
from anelm.generate.chat import PromptCache
from anelm.generate.device_plan import (SizePlan, bucket_options, choose_bucket, decode_seconds, evaluation_seconds,
                                        plan_sizes, resume_pays, serving_buckets)
from anelm.generate.pipeline import build_runner
from anelm.models.loading import load_model

LOGITS_TOL = 3e-2  # logits of a whole tiny model (docs/testing.md)
KV_TOL = 1e-2  # two fp16 device paths of the same arithmetic (test_generate_device.py)
PLAN = SizePlan((16, 512), (512,), 30, 512, (16, 32, 64, 128, 256, 512))  # SmolLM2 at 512: 3 slots a layer


EMULATED = {16: 0.063, 32: 0.108, 64: 0.205, 128: 0.400, 256: 0.788, 512: 1.983, 1024: 5.307}  # SmolLM2, measured


def emulator_like(kind: str, size: int) -> float:
    """Seconds per pass as the emulator takes them for SmolLM2 (its buckets, between them as a
    line, and 22 ms a decode step)."""
    return float(np.interp(size, list(EMULATED), list(EMULATED.values()))) if kind == "prefill" else 0.022


PREDICTED = {16: 0.0048, 32: 0.0049, 64: 0.0068, 128: 0.0126, 256: 0.0297, 512: 0.0868}  # SmolLM2 on an M4


def ane_like(kind: str, size: int) -> float:
    """Seconds per pass as an M4 is predicted (`anelm.chip.cost`): columns nearly free, 7.3 ms a decode step."""
    return float(np.interp(size, list(PREDICTED), list(PREDICTED.values()))) if kind == "prefill" else 0.0073


def test_the_largest_bucket_holds_when_a_decode_step_costs_more():
    assert choose_bucket(37, PLAN, [16], ane_like) == 512  # 0.087 s against 0.0074 + 21 steps of 0.007
    assert choose_bucket(37, PLAN, [16], emulator_like) == 16  # 16 columns and 21 steps: 0.52 s, not 2.0 s
    assert choose_bucket(17, PLAN, [16], ane_like) == 16  # one step is cheaper than 512 columns there too
    assert choose_bucket(300, PLAN, [16], emulator_like) == 512  # 284 steps would take 6.2 s


def test_free_slots_take_ladder_sizes_and_the_largest_stays():
    assert bucket_options(37, PLAN, []) == [16, 32, 64]  # a free slot: any size up to the first that holds 37
    assert choose_bucket(37, PLAN, [], emulator_like) == 64
    assert bucket_options(37, PLAN, [64]) == [64]  # both slots spoken for: 64 and the largest
    assert bucket_options(600, PLAN, [64]) == [64, 512]  # longer than every bucket: the rest decoded
    assert choose_bucket(600, PLAN, [64], emulator_like) == 512
    assert decode_seconds(3, 10, SizePlan((16,), (8, 16), 1, 16), lambda k, t: t) == 5 * 8 + 2 * 16


def test_serving_buckets_fill_the_free_slots():
    assert serving_buckets(PLAN, [], emulator_like) == (64, 512)
    assert serving_buckets(PLAN, [], ane_like) == (128, 512)
    halfway = SizePlan(PLAN.prefill, PLAN.decode, PLAN.layers, PLAN.context, plan_sizes(30, 512, 119, 16).sizes)
    assert halfway.sizes == (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # the ladder and 1.5x its steps
    assert serving_buckets(halfway, [], emulator_like) == (64, 512)  # 49-64 tokens outweigh 48's gain
    assert choose_bucket(37, halfway, [], emulator_like) == 48  # a one-shot prompt: its own size
    assert serving_buckets(PLAN, [32], emulator_like) == (32, 512)  # a bound slot stays bound
    gpt2 = plan_sizes(12, 1024, STRICT.compile_budget)  # 4 prefill slots: 3 free besides 1024
    chosen = serving_buckets(gpt2, [], emulator_like)
    assert len(chosen) == len(gpt2.prefill) and chosen[-1] == 1024 and set(chosen) <= set(gpt2.sizes)


def test_a_cached_prefix_is_resumed_only_where_its_decode_steps_pay():
    # a template's 10 tokens held of a 60-token prompt: 50 steps (1.1 s) against bucket 64 (0.2 s)
    assert not resume_pays(60, 10, PLAN, [64, 512], emulator_like)
    assert resume_pays(60, 52, PLAN, [64, 512], emulator_like)  # 8 steps: 0.18 s, less than 64 columns (0.21 s)
    assert not resume_pays(60, 50, PLAN, [64, 512], emulator_like)  # 10 steps: 0.22 s
    assert not resume_pays(60, 58, PLAN, [64, 512], ane_like)  # predicted on an M4: 2 steps of 7 ms, bucket 64 in 7 ms
    assert resume_pays(600, 560, PLAN, [64, 512], emulator_like)  # past every bucket: the cache is better


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama GQA (context 64) whose plan has 3 slots a layer, as SmolLM2's."""
    root = tmp_path_factory.mktemp("policy")
    hf = hf_tiny.make_hf("llama-gqa", root / "m", seed=5)
    config, weights, _ = load_model(root / "m")
    return hf, config, weights


def scarce_runner(config, weights):
    profile = STRICT.replace(compile_budget=10**9)
    runner = build_runner(config, weights, Emulator(profile))
    slots = 8 + 3 * config.num_hidden_layers  # RESERVE + 3 programs per layer
    runner.plan = plan_sizes(config.num_hidden_layers, 64, slots, 16)
    return runner


def test_a_smaller_bucket_and_decode_steps_give_the_buckets_logits(tiny, cold_compiles):
    hf, config, weights = tiny
    ids = np.random.default_rng(7).integers(0, 96, 40).tolist()
    full, split = scarce_runner(config, weights), scarce_runner(config, weights)
    assert full.plan.prefill == (16, 64) and full.plan.decode == (64,) and full.plan.sizes == (16, 32, 48, 64)
    full.pass_seconds = lambda kind, size: 1.0 if kind == "decode" else size * 1e-3  # steps dear: bucket 48
    split.pass_seconds = lambda kind, size: 1e-6 if kind == "decode" else size * 1e-3  # steps cheap: bucket 16
    before = compile_count()
    a = full.prefill(ids, full.new_cache())
    b = split.prefill(ids, split.new_cache())
    assert full.buckets == [48] and split.buckets == [16]
    assert {s for k, _, s in full.kernels if k == "prefill"} == {48} and {s for k, _, s in split.kernels} == {16, 64}
    assert compile_count() - before == config.num_hidden_layers * 3  # bucket 48; bucket 16 and tier 64
    assert a.shape == b.shape == (40, 96)
    assert rel_err(b, a) <= KV_TOL
    assert rel_err(b, hf_tiny.hf_logits(hf, ids)) <= LOGITS_TOL
    cache = split.new_cache()  # a last-only prefill, as generation runs it, and decoding on from it
    last = split.prefill(ids, cache, last_only=True)
    assert cache.length == 40 and rel_err(last[0], b[-1]) <= 1e-5  # the same state; the head sums in another order
    assert rel_err(split.decode(3, cache), full.prefill(ids + [3], full.new_cache(), last_only=True)[0]) <= KV_TOL


def test_the_runner_predicts_from_its_programs_and_warm_fills_the_slots(tiny):
    _, config, weights = tiny
    runner = scarce_runner(config, weights)
    art = runner._program("prefill", 0, 32)
    assert runner.pass_seconds("prefill", 32) == pytest.approx(2 * emulated_seconds(art.meta["cost"]))
    assert runner.pass_seconds("decode", 64) < runner.pass_seconds("prefill", 64)
    assert evaluation_seconds(art, "ane") < evaluation_seconds(art, "emulator")  # the chip's time, not ours
    n = runner.warm()
    assert n == 3 * config.num_hidden_layers and len(runner.buckets) == 2 and runner.buckets[-1] == 64
    assert {s for k, _, s in runner.kernels if k == "prefill"} == set(runner.buckets)
    runner.prefill(list(range(1, 21)), runner.new_cache())  # a bound bucket or decode steps: nothing compiled
    assert len(runner.kernels) == n
    store = PromptCache(runner)  # a held prefix of 2 positions: 38 steps cost more than a bucket
    cache = runner.new_cache()
    runner.prefill([5, 6, 7], cache)
    store.put([5, 6, 7], cache)
    assert store.take([5, 6] + list(range(10, 48)))[1] == 0
    cache = runner.new_cache()
    runner.prefill(list(range(1, 41)), cache)
    store.put(list(range(1, 41)), cache)
    assert store.take(list(range(1, 41)) + [3, 4])[1] == 40  # 2 steps against a whole bucket: resumed


def test_smollm2_decodes_past_bucket_16_on_the_emulator_and_on_the_chip_in_chunks(smollm):
    config, weights, _ = smollm
    runner = build_runner(config, weights, Emulator(STRICT), max_context=512)
    assert runner.plan.prefill == (16, 512) and runner.plan.decode == (512,)
    runner.buckets = [16]  # the second slot spoken for (the largest always is)
    assert runner.prefill_bucket(37) == 16  # ~0.5 s: 16 columns and 21 steps, not 512 columns (~2 s)
    assert runner.prefill_bucket(300) == 512
    runner.device, runner._seconds = "ane", {}  # the chip's predicted times instead of the emulator's
    assert runner.prefill_bucket(37) == 16  # 21 tokens in two chunks of the decode programs: 4 passes
    runner.chunk = 1
    assert runner.prefill_bucket(37) == 512  # one token a step: 21 steps cost more than 512 columns
    runner.close()
