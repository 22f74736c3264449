"""A tiny random Gemma 3 whose stream passes fp16's range by far, on the emulator under
`strict`, against HF transformers in float32 on the same weights (an HF folder it saved).

Real Gemma 3 reaches 103,795 (on its BOS, an attention sink); this one passes 150,000 from its
embeddings: sink channels of ±160,000 (after Gemma's √hidden) on a few tokens, BOS among them.
(Post-norm gains in the tens of thousands would pass it too, but on random weights they only
amplify fp16's rounding of an MLP output 40,000-fold into logits that rest on those channels:
an ill-conditioned model, not a test of the device.) Its window (8) is shorter than
the texts, its local and global RoPE bases are not Gemma's, its score scale is not head_dim's:
the remedy and the layer must hold for the family, not for one checkpoint. The judges are the
real-model rule of docs/testing.md and its greedy rule.
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny
# the Llama sink test's tokens and channels: BOS and two ordinary tokens, three channels
from test_generate_fp16_range import put_sinks, text_ids  # noqa: E402

torch = hf_tiny.torch

from anelm.chip.profile import STRICT  # noqa: E402
from anelm.device.emulator import Emulator  # noqa: E402
from anelm.generate.perplexity import perplexity  # noqa: E402
from anelm.generate.pipeline import build_runner  # noqa: E402
from anelm.models.loading import load_model  # noqa: E402

NOBUDGET = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test file
AGREEMENT, PPL_RATIO = 0.985, 0.01  # real models (docs/testing.md)


@pytest.fixture(scope="module")
def sink_model(tmp_path_factory):
    """(HF model, device runner) of the tiny Gemma 3 with a stream past 150,000."""
    folder = tmp_path_factory.mktemp("gemma") / "gemma3"
    hf = hf_tiny.make_hf("gemma3", folder, seed=3)
    put_sinks(hf.model.embed_tokens.weight)  # ±20,000, times √64 = 8 on the way in: ±160,000
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # sharpened, so choices are well separated (docs/testing.md)
    hf.save_pretrained(folder)
    config, weights, _ = load_model(folder)
    return hf, build_runner(config, weights, Emulator(NOBUDGET), max_context=64)


def test_the_stream_passes_150000(sink_model):
    hf, runner = sink_model
    with torch.no_grad():
        out = hf(torch.tensor([text_ids(48)]), output_hidden_states=True)
    peak = max(float(h.abs().max()) for h in out.hidden_states)
    assert peak > 150_000, peak
    assert peak / runner.stream_scale < 32768
    assert runner.rings == (16, 16, None, 16)  # window 8 in a ring of 16 columns (strict's multiple)


def test_teacher_forced_choices_and_perplexity_match_hf(sink_model, capsys):
    hf, runner = sink_model
    ids = text_ids(48 * 3)  # three windows, each past the sliding window
    score = perplexity(runner, ids, 48, progress=False)
    ref_nll, rows = hf_tiny.hf_windows(hf, ids, 48)
    agree = float(np.mean(np.asarray(score.argmax) == np.concatenate(rows).argmax(axis=1)))
    ratio = score.ppl / np.exp(ref_nll)
    assert agree >= AGREEMENT, f"argmax agreement {agree:.4f}"
    assert abs(ratio - 1) <= PPL_RATIO, f"perplexity ratio {ratio:.5f}"
    assert "fp16 overflow" not in capsys.readouterr().err  # the overflow warning (docs/chip-profiles.md): none


def test_greedy_decoding_follows_hf_past_the_window(sink_model, capsys):
    hf, runner = sink_model
    # to position 36: the ring of 16 columns wraps twice, the window of 8 moves 28 times
    tokens, judged, wrong = hf_tiny.greedy_against_hf(runner, hf, text_ids(12, seed=4), 24)
    assert not wrong, f"steps {wrong} of {tokens}"
    assert len(judged) >= 12, f"only {len(judged)} of 24 steps were decisive"
    assert "fp16 overflow" not in capsys.readouterr().err
