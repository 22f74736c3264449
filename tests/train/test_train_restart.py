"""The static pipeline under a small compile budget: the trainer checkpoints and re-executes
itself (os.execv, profile kept) before an update would cross the budget, and its losses are
those of the dynamic pipeline, which never recompiles.

The model is a one-layer GQA Llama given with `--init-from` (an HF folder written here), so
one update costs 8 compiles: with a budget of 26 = 2 weightless + 8 initial + 2·8, a process
fits two updates, and 7 steps need three restarts. The budget travels only in the profile
file, passed as `--profile`, so a restarted process that lost it would run unlimited and
print no further restart notices.

Tolerance 1e-4 absolute, the resume contract. Both pipelines compute in fp16 from the same
fp16-rounded weights; the static kernels apply them as 1x1 conv consts and the dynamic ones as
sliced matmul inputs. The emulator computes each op in float32 and rounds its result to fp16,
and the two forms do the same dot products with the same rounding points, so they agree
exactly (measured difference 0.0). On hardware the conv and matmul units may accumulate
differently (up to ~1e-3 relative per layer); this test runs on the emulator. A wrong restart
(a batch repeated or skipped, AdamW state or the schedule reset) moves a loss by 1e-2 or more.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
from safetensors.numpy import save_file

from anelm.chip.profile import STRICT
from anelm.train.data.corpus import write_corpus
from anelm.train.data import train_bpe
from anelm.train.metrics import read_metrics

STEPS = 7


def hf_folder(d, corpus):
    tok = train_bpe([corpus], 300, d / "tokenizer.json")
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": tok.get_vocab_size(),
           "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
    (d / "config.json").write_text(json.dumps(cfg))
    from anelm.models.config import config_from_dict
    from anelm.train.init import init_weights

    save_file(init_weights(config_from_dict(cfg), seed=7), str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("restart")
    corpus = write_corpus(base / "stories.txt", n_bytes=20_000, seed=9)
    model = hf_folder(base, corpus)
    profile = base / "budget26.json"
    profile.write_text(json.dumps({**asdict(STRICT), "name": "budget26", "compile_budget": 26,
                                   "rejected_ops": list(STRICT.rejected_ops)}))
    # the kernel cache off: a restarted process would load, not compile, what the last one compiled
    env = {**os.environ, "ANELM_CACHE_DIR": str(base / "cache"), "ANELM_KERNEL_CACHE_MB": "0"}
    env.pop("ANELM_PROFILE", None)
    common = ["--init-from", str(model), "--data", str(corpus), "--steps", str(STEPS), "--batch-size", "2",
              "--seq-len", "16", "--lr", "3e-3", "--eval-every", "3", "--eval-batches", "1",
              "--sample-tokens", "0", "--device", "emulator"]
    procs = {name: subprocess.Popen([sys.executable, "-m", "anelm", "train", *common, "--out",
                                     str(base / name), *extra], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, extra in (("static", ["--pipeline", "static", "--profile", str(profile)]),
                                 ("dynamic", ["--pipeline", "dynamic"]))}
    out = {}
    for name, p in procs.items():
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"{name} run failed:\n{err[-3000:]}"
        out[name] = (base / name, err)
    return out


def test_static_pipeline_restarts_at_the_budget_and_matches_dynamic(runs):
    static_dir, err = runs["static"]
    assert err.count("restarting the process") == 3, err[-3000:]
    assert err.count("resuming at step") == 3
    recs = [r for r in read_metrics(static_dir) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))  # each step once, none lost
    dyn = {r["step"]: r["loss"] for r in read_metrics(runs["dynamic"][0]) if "loss" in r}
    got = np.array([r["loss"] for r in recs])
    want = np.array([dyn[s] for s in range(1, STEPS + 1)])
    assert np.max(np.abs(got - want)) <= 1e-4, (got, want)
    assert want[-1] < want[0]  # it trains, so the comparison covers real updates
    evals = [r["step"] for r in read_metrics(static_dir) if "eval_loss" in r]
    assert evals == [3, 6, 7]  # no eval lost or repeated across the restarts


def test_restarted_run_kept_its_settings(runs):
    static_dir, _ = runs["static"]
    cfg = json.loads((static_dir / "config.json").read_text())
    assert cfg["anelm_train"]["pipeline"] == "static" and cfg["anelm_train"]["steps"] == STEPS
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
