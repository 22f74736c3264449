"""Gemma 3 270M (Q4_K_M GGUF, from the test extras) on the emulator under `strict`, against HF
transformers in float32 reading the same file.

Gemma 3's residual stream reaches 103,795 on its first token (HF float32, measured per layer),
past fp16's 65,504: HF itself in plain fp16 gives inf. The device carries the stream divided
by a power of two chosen from the model (`stream_scale_for`), folded into the embedding and
the post-norm gains, so every norm's output is unchanged. Five of every six layers attend
within a 512-key window with their own RoPE base, so one text runs past the window.
The judges: docs/testing.md's real-model rule (argmax agreement >= 98.5 %, perplexity ratio
within 1 %), past the window a looser one (within 1.5 %, >= 98 % on the positions past 512), and
its greedy rule (HF's choice wherever HF's own top-2 margin is at least 5 % of max|logit|).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from anelm.chip.profile import STRICT  # noqa: E402
from anelm.device.emulator import Emulator  # noqa: E402
from anelm.generate.device_plan import MAX_CONTEXT  # noqa: E402
from anelm.generate.perplexity import perplexity  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from hf_tiny import greedy_against_hf, hf_logits, hf_windows  # noqa: E402
from real_models import SHARED  # noqa: E402

AGREEMENT, PPL_RATIO = 0.985, 0.01  # real models (docs/testing.md)
LONG_AGREEMENT, LONG_RATIO = 0.98, 0.015  # past the 512-key window, a looser bound
CONTEXT = 1024  # one runner for every test: prefill buckets and decode tiers up to 1024 positions
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def runner(gemma):
    config, weights, _ = gemma
    r = build_runner(config, dict(weights), Emulator(STRICT), max_context=CONTEXT)
    yield r
    r.close()


@pytest.fixture(scope="module")
def prose_ids(gemma):
    prose = SHARED / "data" / "text" / "apache-2.0.txt"  # ordinary English prose
    if not prose.is_file():
        pytest.skip(f"{prose} is absent: ../shared (external fixtures) is not part of a user's clone")
    return gemma[2].encode(prose.read_text(encoding="utf-8"))


def test_the_config_and_stream_scale_come_from_the_file(runner, gemma):
    from anelm.models.loading import build_model

    config = gemma[0]
    assert (config.model_type, config.sliding_window, config.num_hidden_layers) == ("gemma3_text", 512, 18)
    assert [config.window(i) for i in range(6)] == [512] * 5 + [None]
    assert config.rope(0)[0] == 10_000.0 and config.rope(5)[0] == 1_000_000.0
    cpu = build_model(config, dict(gemma[1]))
    assert cpu.stream_peak([2, 818, 5279, 529]) > 65504  # the reason for the scale (BOS is the sink)
    assert cpu.stream_peak([2, 818, 5279, 529]) < cpu.stream_bound() < 32768 * runner.stream_scale
    assert runner.stream_scale == 32.0  # measured peak 103,795 -> 3,244 inside the kernels


def test_the_generate_plan_fits_the_compile_budget(gemma):
    config, weights, _ = gemma
    from anelm.generate.device_plan import RESERVE, plan_sizes

    plan = plan_sizes(config.num_hidden_layers, MAX_CONTEXT, STRICT.compile_budget, STRICT.spatial_multiple_of)
    assert plan.max_compiles <= STRICT.compile_budget - RESERVE
    assert plan.prefill[0] == 16 and plan.decode[-1] == MAX_CONTEXT


@pytest.mark.parametrize("prompt", PROMPTS + ["  two spaces\tand a tab", "naïve café, 1234567 €"])
def test_prompt_ids_equal_hf(gemma, gemma_hf, prompt):
    assert gemma[2].encode(prompt) == gemma_hf[1](prompt)["input_ids"]


def test_perplexity_and_choices_on_prose_match_hf(runner, gemma_hf, prose_ids, capsys):
    ids = prose_ids[:300]
    score = perplexity(runner, ids, 300, progress=False)
    ref_nll, rows = hf_windows(gemma_hf[0], ids, 300)
    agree = float(np.mean(np.asarray(score.argmax) == np.concatenate(rows).argmax(axis=1)))
    ratio = score.ppl / np.exp(ref_nll)
    assert agree >= AGREEMENT, f"argmax agreement {agree:.4f}"
    assert abs(ratio - 1) <= PPL_RATIO, f"perplexity ratio {ratio:.5f}"
    assert "fp16 overflow" not in capsys.readouterr().err  # the overflow warning (docs/chip-profiles.md): none


def test_past_the_sliding_window(runner, gemma_hf, prose_ids, capsys):
    """700 positions: the local layers' window (512) cuts every query past position 511."""
    ids = prose_ids[:700]
    score = perplexity(runner, ids, 700, progress=False)
    ref_nll, rows = hf_windows(gemma_hf[0], ids, 700)
    same = np.asarray(score.argmax) == rows[0].argmax(axis=1)
    ratio = score.ppl / np.exp(ref_nll)
    assert abs(ratio - 1) <= LONG_RATIO, f"perplexity ratio {ratio:.5f}"
    assert same.mean() >= LONG_AGREEMENT and same[512:].mean() >= LONG_AGREEMENT, \
        f"argmax agreement {same.mean():.4f}, past 512: {same[512:].mean():.4f}"
    assert "fp16 overflow" not in capsys.readouterr().err


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generation_follows_hf(runner, gemma, gemma_hf, prompt, capsys):
    tokens, judged, wrong = greedy_against_hf(runner, gemma_hf[0], gemma[2].encode(prompt), 16)
    assert not wrong, f"{prompt!r}: steps {wrong} of {gemma[2].decode(tokens)!r}"
    assert len(judged) >= 4, f"only {len(judged)} of 16 steps were decisive: the check is nearly vacuous"
    assert "fp16 overflow" not in capsys.readouterr().err


def test_decode_past_the_window_reads_the_ring(runner, gemma_hf, prose_ids, capsys):
    """A 600-token prompt, then 8 tokens decoded teacher-forced: the local layers' caches hold
    the last 512 positions in a ring (position p in column p mod 512), read whole by their
    decode programs, against HF's logits at the same positions."""
    assert runner.rings == tuple(512 if (i + 1) % 6 else None for i in range(18))
    ids, follow = prose_ids[:600], prose_ids[600:608]
    cache = runner.new_cache()
    ours = [runner.prefill(ids, cache, last_only=True)[-1]]
    ours += [runner.decode(t, cache) for t in follow[:-1]]
    ref = hf_logits(gemma_hf[0], ids + follow[:-1])[599:]
    assert (np.argmax(ours, axis=1) == np.argmax(ref, axis=1)).mean() >= 7 / 8
    assert np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max() <= 3e-2  # a whole model's logits (docs/testing.md)
    assert "fp16 overflow" not in capsys.readouterr().err
