"""`anelm train` and `anelm export` from the command line: flags, one-line errors that lose
nothing, export parity with `transformers`, `generate --model RUN`, and a shortened default run.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.train.data.corpus import write_corpus

CONTRACT_FLAGS = ["--preset", "--data", "--tokenizer", "--steps", "--batch-size", "--seq-len", "--lr",
                  "--out", "--device", "--pipeline", "--resume", "--init-from", "--seed", "--profile"]


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "stories.txt", n_bytes=20_000, seed=1)


def error_of(capsys, argv, code):
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anelm: error: "), err
    return err[0]


def test_help_lists_the_contract_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert all(f in out for f in CONTRACT_FLAGS)
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "--out" in capsys.readouterr().out


# ----------------------------------------------------------------------- bad input

def small(corpus, out, *more):
    return ["train", "--data", str(corpus), "--out", str(out), "--steps", "2", "--seq-len", "16",
            "--batch-size", "2", "--bpe-vocab-size", "300", "--device", "emulator", *more]


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"),
    (b"", "is empty"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00binary", "looks binary"),
])
def test_bad_data_is_one_line_and_leaves_no_run(tmp_path, capsys, content, words):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    out = tmp_path / "run"
    msg = error_of(capsys, small(data, out), 1)
    assert words in msg and str(data) in msg
    assert not out.exists()  # the failed start removed the folder it had created


def test_tokenizer_larger_than_the_model_is_refused(tmp_path, corpus, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 2000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    msg = error_of(capsys, small(corpus, tmp_path / "run", "--tokenizer", str(tmp_path / "tokenizer.json")), 1)
    assert "2000 ids" in msg and "vocab_size is 1024" in msg


def test_unwritable_out_and_unknown_preset(tmp_path, corpus, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    msg = error_of(capsys, small(corpus, blocker / "run"), 1)
    assert "cannot write to run folder" in msg
    msg = error_of(capsys, small(corpus, tmp_path / "r", "--preset", "Tiny"), 2)
    assert "unknown preset 'Tiny'" in msg and "tiny" in msg


@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], "positive integer"),
    (["--lr", "-1"], "positive number"),
    (["--lr", "nan"], "positive number"),
    (["--seq-len", "4096"], "context of 128"),
    (["--warmup", "5"], "at most --steps"),
    (["--loss-scale", "banana"], "--loss-scale"),
    (["--pipeline", "fast"], "invalid choice"),
    (["--batch-size", "two"], "positive integer"),
    (["--clip", "-0.5"], ">= 0"),
    (["--preset", "tiny", "--init-from", "somewhere"], "both name the model"),
])
def test_impossible_flag_values_are_usage_errors(tmp_path, corpus, capsys, flags, words):
    msg = error_of(capsys, small(corpus, tmp_path / "run", *flags), 2)
    assert words in msg
    assert not (tmp_path / "run").exists()


def test_an_unavailable_device_leaves_no_run(tmp_path, corpus, capsys):
    from anelm.device.select import _try_ane
    from anelm.chip.profile import STRICT

    if _try_ane(STRICT)[0] is not None:
        pytest.skip("a real ANE is available here")
    msg = error_of(capsys, small(corpus, tmp_path / "run")[:-2] + ["--device", "ane"], 1)
    assert "--device ane" in msg and "unavailable" in msg
    assert not (tmp_path / "run").exists()


def test_an_existing_run_is_not_overwritten(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"keep": true}')
    msg = error_of(capsys, small(corpus, run), 1)
    assert "already holds a run" in msg and "--resume" in msg
    assert json.loads((run / "config.json").read_text()) == {"keep": True}


# --------------------------------------------------------------------------- export

def fake_run(d, cfg, seed, corpus):
    """A run folder as the trainer leaves it: config.json, tokenizer.json, one checkpoint."""
    from anelm.models.config import config_from_dict
    from anelm.train.checkpoint import Checkpoint, save_checkpoint
    from anelm.train.data import train_bpe
    from anelm.train.init import init_weights

    d.mkdir(parents=True)
    train_bpe([corpus], cfg["vocab_size"], d / "tokenizer.json")
    config = config_from_dict(cfg)
    w = init_weights(config, seed, std=0.2)
    rng = np.random.default_rng(seed)
    for k, v in w.items():
        if v.ndim == 1:  # norms away from 1, so a dropped or misnamed norm shows
            v += rng.normal(0, 0.2, v.shape).astype(np.float32)
    (d / "config.json").write_text(json.dumps({**config.to_dict(), "anelm_train": {"steps": 9}}))
    save_checkpoint(d, Checkpoint(step=9, config=cfg, weights=w))
    return d


BASE = {"vocab_size": 300, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("arch, heads, kv, tied", [
    ("llama", 4, 4, True), ("llama", 4, 2, False), ("qwen3", 4, 2, True)])
def test_export_loads_in_transformers_with_our_logits(tmp_path, corpus, capsys, arch, heads, kv, tied):
    import torch
    from transformers import AutoModelForCausalLM

    from anelm.models.loading import build_model, load_model

    cfg = {**BASE, "model_type": arch, "num_attention_heads": heads, "num_key_value_heads": kv,
           "head_dim": 16, "tie_word_embeddings": tied, "rope_theta": 1e4 if arch == "llama" else 1e6}
    run = fake_run(tmp_path / "run", cfg, seed=heads + kv, corpus=corpus)
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "step 9" in capsys.readouterr().err
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    assert type(hf).__name__ == ("LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM")
    config, weights, tok = load_model(run)
    ids = tok.encode("Once upon a time, Lily the cat saw a red ball in the park.")
    ours = build_model(config, weights).forward(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def test_export_refuses_what_it_cannot_do_in_one_line(tmp_path, corpus, capsys):
    run = fake_run(tmp_path / "run", {**BASE, "model_type": "llama", "num_attention_heads": 4,
                                      "tie_word_embeddings": True}, seed=1, corpus=corpus)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    assert "not an empty folder" in error_of(capsys, ["export", str(run), "--out", str(taken)], 1)
    assert (taken / "mine.txt").read_text() == "keep"
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert "no checkpoints" in error_of(capsys, ["export", str(empty), "--out", str(tmp_path / "x")], 1)
    nope = tmp_path / "nope"  # once said "has no checkpoints" as well
    assert f"{nope} does not exist; expected a run folder" in error_of(capsys, ["export", str(nope), "--out",
                                                                              str(tmp_path / "x")], 1)


def test_generate_reads_a_run_folder(tmp_path, corpus, capsys):
    run = fake_run(tmp_path / "run", {**BASE, "model_type": "llama", "num_attention_heads": 4,
                                      "tie_word_embeddings": False}, seed=2, corpus=corpus)
    assert main(["generate", "--model", str(run), "--prompt", "Once upon", "--max-tokens", "5",
                 "--temperature", "0", "--json", "--device", "emulator"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["ids"]) <= 5 and res["prompt_ids"]


# --------------------------------------------------------------- the default run, shortened

@pytest.mark.slow
def test_shortened_default_run_trains_end_to_end(tmp_path):
    """`anelm train` with only --steps (and a coarser eval) changed: tiny, built-in corpus,
    --device auto. ~30 s."""
    env = {**os.environ, "ANELM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("ANELM_PROFILE", None)
    p = subprocess.run([sys.executable, "-m", "anelm", "train", "--steps", "16", "--eval-every", "8"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "anelm: device: emulator" in p.stderr and "done: 16 steps" in p.stderr
    assert p.stdout.strip(), "no sample printed"
    (run,) = (tmp_path / "runs").iterdir()  # the default runs/<timestamp>
    from anelm.train.metrics import read_metrics

    recs = read_metrics(run)
    losses = [r["loss"] for r in recs if "loss" in r]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    vocab = json.loads((run / "config.json").read_text())["vocab_size"]
    assert len(losses) == 16 and len(evals) == 2
    assert abs(losses[0] - math.log(vocab)) < 0.3  # starts at chance: a fresh, small init
    assert evals[-1] < evals[0] and evals[-1] < 0.85 * math.log(vocab)
    assert (run / "loss.png").exists() and (run / "checkpoints" / "step-000016.safetensors").exists()
