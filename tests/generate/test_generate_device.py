"""The device pipeline (anelm.generate.pipeline) on the emulator against HF `transformers`.

Oracles: tiny random HF models built from a config and saved with `save_pretrained`
(tests/hf_tiny.py), run by torch in float32. The pipeline runs every decoder layer as
a program our compiler made, in fp16 on the emulator, so the tolerances are docs/testing.md's:
whole-model logits ≤ 3e-2 of max|ref|, and greedy choices equal to HF's except where HF's own
top-2 margin is under 5 % of max|logit|. The models' weights are drawn large (hf_tiny: std
0.3, a sharp output distribution), yet with 96 random logits about a third of the steps are
such near-ties; the tests count the decisive steps so that they cannot pass on ties alone.
"""

import json

import numpy as np
import pytest

import hf_tiny
from helpers import decisive, rel_err

torch = hf_tiny.torch

from anelm.device.base import compile_count  # noqa: E402
from anelm.device.emulator import Emulator  # noqa: E402
from anelm.chip.profile import STRICT  # noqa: E402
from anelm.generate.device_plan import DeviceCache, plan_sizes  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.generate.runner import Runner, make_runner  # noqa: E402
from anelm.models.errors import ContextError  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402

KINDS = ["gpt2", "llama-mha", "llama-gqa", "llama-rope3", "llama-yarn", "qwen3-tied", "qwen3-untied"]
PROMPTS = [[1, 5, 9, 22], [1] + list(range(40, 61)), [7], list(range(70, 86))]  # buckets 16, 32, 16, 16
N_NEW = 12
LOGITS_TOL = 3e-2  # logits of a whole tiny model (docs/testing.md)
KV_TOL = 1e-2  # two fp16 device paths of the same arithmetic (cached decode vs one prefill pass)
NOBUDGET = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test file


@pytest.fixture(scope="module")
def device():
    return Emulator(NOBUDGET)


@pytest.fixture(scope="module")
def models(tmp_path_factory, device):
    """kind -> (runner, HF model, config, float32 weights)."""
    root = tmp_path_factory.mktemp("device")
    out = {}
    for i, kind in enumerate(KINDS):
        hf = hf_tiny.make_hf(kind, root / kind, seed=10 + i)
        config, weights, _ = load_model(root / kind)
        out[kind] = (build_runner(config, weights, device), hf, config, weights)
    return out


def greedy_run(runner, prompt, n):
    """(tokens, per-step logits [n, V]) of greedy generation through prefill + decode."""
    cache = runner.new_cache()
    logits = [runner.prefill(prompt, cache, last_only=True)[-1]]
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(n - 1):
        logits.append(runner.decode(tokens[-1], cache))
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, np.stack(logits)


def check_choice(theirs: np.ndarray, tok: int, step: int) -> bool:
    """Our token against HF's greedy choice under the tie rule; True when HF's was decisive."""
    if not decisive(theirs):
        return False  # a near-tie: either choice is HF-consistent (docs/testing.md)
    assert tok == int(np.argmax(theirs)), f"step {step}: chose {tok}, HF {int(np.argmax(theirs))}"
    return True


def check_against_hf(hf, prompt, tokens, logits) -> int:
    """HF on prompt + our tokens, teacher-forced: the same choice at every step (tie rule),
    logits within LOGITS_TOL. Returns how many steps were decisive."""
    ref = hf_tiny.hf_logits(hf, prompt + tokens)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    decisive = 0
    for step, (ours, theirs, tok) in enumerate(zip(logits, ref, tokens)):
        err = rel_err(ours, theirs)
        assert err <= LOGITS_TOL, f"step {step}: logits differ by {err:.4f} of max|ref|"
        decisive += check_choice(theirs, tok, step)
    return decisive


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_follows_hf(models, kind):
    runner, hf, _, _ = models[kind]
    assert isinstance(runner, Runner) and runner.device == "emulator"
    decisive = sum(check_against_hf(hf, p, *greedy_run(runner, p, N_NEW)) for p in PROMPTS)
    assert decisive >= 0.5 * N_NEW * len(PROMPTS), f"only {decisive} decisive steps: the check is vacuous"


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_of_every_position_match_hf(models, kind):
    runner, hf, _, _ = models[kind]
    ids = np.random.default_rng(3).integers(0, 96, 40).tolist()  # bucket 64: all of the context's ladder
    got = runner.prefill(ids, runner.new_cache())
    assert got.shape == (40, 96)
    assert rel_err(got, hf_tiny.hf_logits(hf, ids)) <= LOGITS_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_matches_full_recompute(models, kind):
    runner, _, _, _ = models[kind]
    prompt, more = [1, 5, 9, 22, 3], np.random.default_rng(1).integers(0, 96, 14).tolist()
    cache = runner.new_cache()
    steps = [runner.prefill(prompt, cache, last_only=True)[-1]]
    steps += [runner.decode(t, cache) for t in more[:8]]
    steps += list(runner.prefill(more[8:], cache))  # a continued prompt (chat turn) runs via decode
    assert cache.length == len(prompt) + len(more)
    full = runner.prefill(prompt + more, runner.new_cache())[len(prompt) - 1:]
    err = rel_err(np.stack(steps), full)
    assert err <= KV_TOL, err


def test_compiles_per_layer_and_bucket_not_per_token(models, cold_compiles):
    _, _, config, weights = models["llama-gqa"]
    runner = build_runner(config, weights, Emulator(NOBUDGET))
    layers, before = config.num_hidden_layers, compile_count()
    greedy_run(runner, [1, 5, 9], 20)  # bucket 16, positions 3..22: one decode tier
    assert compile_count() - before == layers * (1 + 1)
    greedy_run(runner, [4, 8, 15, 16, 23, 42], 20)  # same bucket and tier: nothing new
    greedy_run(runner, list(range(3, 30)), 6)  # bucket 32
    assert compile_count() - before == layers * (2 + 1)
    assert sorted({(kind, size) for kind, _, size in runner.kernels}) == [("decode", 64), ("prefill", 16),
                                                                          ("prefill", 32)]
    for k in runner.kernels.values():
        assert "concat" not in k.artifact.mil_text and "gelu" not in k.artifact.mil_text


def test_size_plan_fits_the_compile_budget():
    budget = STRICT.compile_budget
    assert budget == 115
    gpt2 = plan_sizes(12, 1024, budget)
    assert gpt2.prefill == (16, 64, 256, 1024) and gpt2.decode == (64, 128, 256, 1024)
    assert gpt2.max_compiles == 96 <= budget - 8 and gpt2.bucket(32) == 64 and gpt2.tier(64) == 128
    deep = plan_sizes(28, 4096, budget)  # Qwen3-0.6B's depth: 3 programs per layer
    assert deep.prefill == (16, 1024) and deep.decode == (4096,) and deep.max_compiles == 84
    tiny = plan_sizes(2, 64, budget)
    assert tiny.prefill == (16, 32, 64) and tiny.decode == (64,)
    with pytest.raises(Exception, match="compile budget"):
        plan_sizes(60, 1024, budget)


def test_sizes_are_io_widths_in_the_profiles_multiple():
    odd = plan_sizes(2, 100, STRICT.compile_budget, STRICT.spatial_multiple_of)  # a context of 100 positions
    assert odd.prefill == (16, 32, 64, 112) and odd.decode == (64, 112) and odd.context == 100
    assert odd.tier(99) == 112 and odd.bucket(100) == 112


def test_context_is_enforced(models):
    runner, _, config, _ = models["gpt2"]
    cache = runner.new_cache()
    assert cache.capacity == config.max_position_embeddings == 64
    with pytest.raises(ContextError):
        runner.prefill(list(range(65)), cache)
    runner.prefill(list(range(63)), cache, last_only=True)
    runner.decode(5, cache)  # position 63, the last
    with pytest.raises(ContextError):
        runner.decode(5, cache)


def test_make_runner_builds_the_device_pipeline(models, device):
    _, _, config, weights = models["qwen3-tied"]
    runner = make_runner(config, weights, device)
    assert runner.device == "emulator" and type(runner).__name__ == "DeviceRunner"


@pytest.fixture
def cli_model(tmp_path):
    """A tiny Llama GQA with a word-level tokenizer.json whose ids are the model's."""
    d = tmp_path / "llama"
    return d, hf_tiny.make_word_model(d)


def test_cli_generate_on_the_emulator(cli_model, capsys, fresh_compile_count):
    from anelm.cli.main import main

    d, hf = cli_model
    rc = main(["generate", "--model", str(d), "--device", "emulator", "--json", "--temperature", "0",
               "--prompt", "w5 w9 w22 w40", "--max-tokens", "10"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.count("\n") == 1, err
    res = json.loads(out)
    assert res["device"] == "emulator" and res["prompt_ids"] == [5, 9, 22, 40]
    assert "anelm: device: emulator" in err
    prompt, ids = res["prompt_ids"], res["ids"]
    # HF's choice after each prefix of ours; generation stops at EOS (2), which ids leave out
    ref = hf_tiny.hf_logits(hf, prompt + ids)[len(prompt) - 1:]
    expect = ids + ([] if len(ids) == 10 else [2])
    assert len(ids) > 0 and sum(check_choice(theirs, tok, i) for i, (theirs, tok) in enumerate(zip(ref, expect))) > 0


def resident_steps(kernel) -> int:
    """How many of a kernel's steps hold their conv weight as fp16 (device/emulator_matvec)."""
    from anelm.device.emulator.matvec import ResidentConv

    return sum(isinstance(st.fn, ResidentConv) for st in kernel.model.plan.steps)


def test_decode_across_a_tier_keeps_its_cache_in_the_requests(tmp_path, monkeypatch):
    """A context of 128 gives two decode tiers (64, 128): positions 20..89 cross from the first
    into the second, whose requests are filled from the host cache once, then one column per
    token. Every step against HF (tie rule, LOGITS_TOL) and against one prefill pass over the whole sequence
    (KV_TOL); every decode conv and the head go through the fp16 matrix-vector product."""
    from dataclasses import replace

    from anelm.device.emulator import matvec as emulator_matvec

    hf = hf_tiny.make_hf("llama-gqa", tmp_path / "m", seed=31)
    config, weights, _ = load_model(tmp_path / "m")
    config = replace(config, max_position_embeddings=128)  # RoPE: HF runs any position
    runner = build_runner(config, weights, Emulator(NOBUDGET))
    assert runner.plan.decode == (64, 128)
    ids = np.random.default_rng(4).integers(0, 96, 90).tolist()
    cache = runner.new_cache()
    steps = [runner.prefill(ids[:20], cache, last_only=True)[-1]]
    calls, real = [], emulator_matvec.half_matvec
    monkeypatch.setattr(emulator_matvec, "half_matvec", lambda bits, x: calls.append(bits.shape) or real(bits, x))
    for t in ids[20:-1]:
        calls.clear()
        steps.append(runner.decode(t, cache))
        tier = runner.plan.tier(cache.length - 1)
        convs = sum(resident_steps(runner.kernels[("decode", i, tier)]) for i in range(config.num_hidden_layers))
        assert convs >= 3 * config.num_hidden_layers and len(calls) == convs + 1  # + the head
    assert {k[2] for k in runner.kernels if k[0] == "decode"} == {64, 128} and cache.width == 128
    steps = np.stack(steps)
    ref = hf_tiny.hf_logits(hf, ids)[19:-1]
    assert rel_err(steps, ref) <= LOGITS_TOL
    full = runner.prefill(ids[:-1], runner.new_cache())[19:]  # bucket 128, no decode at all
    assert rel_err(steps, full) <= KV_TOL


def test_the_runner_keeps_fp16_layers_and_head_only(models):
    from anelm.device.emulator.matvec import HalfMatrix

    for kind in ("llama-gqa", "gpt2"):
        runner, _, config, weights = models[kind]
        kept = runner.cpu.weights
        layer = [k for k in weights if k.startswith(("model.layers.", "transformer.h."))]
        assert not [k for k in layer if k in kept and np.ndim(kept[k]) == 2]  # no float32 layer matrix
        assert all(k in kept for k in layer if np.ndim(weights[k]) == 1)  # norm vectors, for adapters
        assert {w.dtype for p in runner.layers for w, _ in p.values() if np.ndim(w) == 2} == {np.dtype(np.float16)}
        assert isinstance(runner.head, HalfMatrix)


def test_prefill_multiplies_the_fp16_layer_weights_and_keeps_no_float32_copy(models, monkeypatch):
    """A 22-token prompt runs bucket 32, evaluated whole (not column by column): every conv reads
    its weight's fp16 patterns through the register tiles (device/emulator_matvec), so no
    prefill kernel holds a float32 copy afterwards, and the logits are those of the float32-copy
    product it replaced (the same sums, some in another order: KV_TOL)."""
    from anelm.device.emulator.accum import saturate
    from anelm.device.emulator.matvec import ResidentConv, ResidentWeight, widen

    def whole_float32_product(w, x, bias=None, limit=None):  # the route before, bias and limit after
        out = np.matmul(widen(w.bits()), x)
        out = out if bias is None else out + bias.reshape(-1, 1)
        return out if limit is None else saturate(out, limit)

    runner, _, config, _ = models["llama-gqa"]
    prompt = PROMPTS[1]
    got = runner.prefill(prompt, runner.new_cache())
    held = [st.fn.weight for key, k in runner.kernels.items() if key[0] == "prefill" and key[2] == 32
            for st in k.model.plan.steps if isinstance(st.fn, ResidentConv)]
    assert len(held) >= 3 * config.num_hidden_layers
    assert all(w.f32 is None and w.nbytes == w.f16.size * 2 for w in held)
    monkeypatch.setattr(ResidentWeight, "times", whole_float32_product)
    before = runner.prefill(prompt, runner.new_cache())
    assert rel_err(got, before) <= KV_TOL


def test_a_warm_kernel_cache_decodes_as_the_cold_compile(models, tmp_path, monkeypatch):
    """Programs loaded from the on-disk kernel cache (a new device: nothing in the process-wide
    program cache) give the cold compile's logits bit for bit, and compile nothing."""
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)
    _, _, config, weights = models["qwen3-untied"]
    cold = build_runner(config, weights, Emulator(NOBUDGET))
    before = compile_count()
    tokens, logits = greedy_run(cold, [1, 5, 9, 22], 10)
    assert compile_count() - before == 2 * config.num_hidden_layers
    warm = build_runner(config, weights, Emulator(NOBUDGET))  # kept apart from `cold`: another device
    before = compile_count()
    again, logits_again = greedy_run(warm, [1, 5, 9, 22], 10)
    assert compile_count() == before and again == tokens
    np.testing.assert_array_equal(logits_again, logits)
    assert all(k.model.func is None for k in warm.kernels.values())  # every plan replayed from its record


def test_a_growing_cache_keeps_its_positions_and_zeros_the_rest():
    cache = DeviceCache(2, 3, 64)
    cache.reserve(16)
    cache.k[:, :, :5], cache.v[:, :, :5] = 1.5, -2.0
    cache.reserve(64)
    assert cache.width == 64 and cache.k.dtype == cache.v.dtype == np.float16
    assert (cache.k[:, :, :5] == 1.5).all() and (cache.v[:, :, :5] == -2.0).all()
    assert not cache.k[:, :, 5:].any() and not cache.v[:, :, 5:].any()


def test_ring_mask_shows_the_window_in_ring_columns():
    from anelm.kernels.decode import decode_mask

    seen = lambda m, j=0: set(np.nonzero(m[0, 0, :, j] == 0)[0].tolist())  # noqa: E731  (column j's)
    assert seen(decode_mask(5, 16, window=8, ring=16)) == {0, 1, 2, 3, 4}
    # position 21 sees 14..20 (the window of 8 holds itself): columns 14, 15, 0..4 of the ring
    assert seen(decode_mask(21, 16, window=8, ring=16)) == {14, 15, 0, 1, 2, 3, 4}
    assert seen(decode_mask(21, 32, window=8)) == set(range(14, 21))
    # a chunk of 3 tokens from position 21 in 4 columns: each sees the positions before its own
    m = decode_mask(21, 32, window=8, columns=4, tokens=3)
    assert m.shape == (1, 1, 32, 4) and seen(m, 2) == set(range(16, 23)) and seen(m, 3) == seen(m, 2)
    assert [seen(m, j) for j in range(3)] == [set(range(14 + j, 21 + j)) for j in range(3)]
