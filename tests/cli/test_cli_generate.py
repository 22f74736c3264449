"""`anelm generate` and `anelm chat` through `anelm.cli.main.main`, against HF greedy decoding."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("transformers")
_spec = importlib.util.spec_from_file_location("hf_tiny", Path(__file__).resolve().parents[1] / "models" / "hf_tiny.py")
hf_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_tiny)
torch = hf_tiny.torch

from anelm.cli.main import main  # noqa: E402

WORDS = hf_tiny.WORDS  # id i is word "w{i}"
KEYS = {"prompt_ids", "ids", "text", "prefill_ms", "decode_tokens_per_s", "device"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny HF Llama (GQA) with a word-level tokenizer.json whose ids are the model's."""
    d = tmp_path_factory.mktemp("cli") / "llama"
    return d, hf_tiny.make_word_model(d)


def hf_greedy(hf, prompt_ids, n):
    """HF's greedy continuation, cut at its first EOS (2) as our generate stops there."""
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    ids = out[0, len(prompt_ids):].tolist()
    return ids[: ids.index(2)] if 2 in ids else ids


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_is_one_line_and_follows_hf_greedy(model_dir, capsys, fresh_compile_count):
    d, hf = model_dir
    rc, out, err = cli(capsys, "generate", "--model", str(d), "--prompt", "w5 w9 w22 w40", "--max-tokens=12",
                       "--temperature", "0", "--json")
    assert rc == 0 and out.count("\n") == 1
    res = json.loads(out)
    assert set(res) == KEYS
    assert res["prompt_ids"] == [5, 9, 22, 40]
    assert res["ids"] == hf_greedy(hf, [5, 9, 22, 40], 12)
    assert res["text"] == "".join(" " + WORDS[i] for i in res["ids"])  # continues the prompt's text
    assert res["device"] == "emulator" and res["prefill_ms"] > 0  # --device auto off a Mac
    assert "anelm: device: emulator" in err


def test_streams_text_to_stdout_and_notices_to_stderr(model_dir, capsys):
    d, hf = model_dir
    rc, out, err = cli(capsys, "generate", "--model", str(d), "--prompt", "w7 w8", "--max-tokens", "6",
                       "--temperature", "0")
    expect = "".join(" " + WORDS[i] for i in hf_greedy(hf, [7, 8], 6))
    assert rc == 0 and out == expect + "\n"
    assert "tokens/s" in err and all(line.startswith("anelm: ") for line in err.splitlines())


def test_sampling_flags_and_seed(model_dir, capsys):
    d, _ = model_dir
    args = ["generate", "--model", str(d), "--prompt", "w7", "--max-tokens", "10", "--temperature", "1.5",
            "--top-k", "20", "--top-p", "0.9", "--repetition-penalty", "1.2", "--seed", "3", "--json"]
    first, second = (json.loads(cli(capsys, *args)[1]) for _ in range(2))
    assert first["ids"] == second["ids"] and len(first["ids"]) > 0


def test_stop_strings_are_repeatable(model_dir, capsys):
    d, hf = model_dir
    words = [WORDS[i] for i in hf_greedy(hf, [5, 9, 22, 40], 12)]
    rc, out, _ = cli(capsys, "generate", "--model", str(d), "--prompt", "w5 w9 w22 w40", "--temperature", "0",
                     "--stop", "never-seen", "--stop", words[2], "--json")
    assert rc == 0 and json.loads(out)["text"] == f" {words[0]} {words[1]} "


def test_device_hook_uses_the_pipeline_when_present(model_dir, capsys, monkeypatch):
    from anelm.models.loading import build_model

    d, _ = model_dir
    calls = []

    def build_runner(config, weights, device, max_context=None):
        calls.append(device)
        runner = build_model(config, weights)
        runner.device = "emulator"
        return runner

    monkeypatch.setitem(sys.modules, "anelm.generate.pipeline", types.SimpleNamespace(build_runner=build_runner))
    rc, out, err = cli(capsys, "generate", "--model", str(d), "--prompt", "w5", "--max-tokens", "2",
                       "--device", "emulator", "--json")
    assert rc == 0 and calls == ["emulator"] and json.loads(out)["device"] == "emulator"
    monkeypatch.setitem(sys.modules, "anelm.generate.pipeline", None)  # as if the module did not exist
    rc, out, err = cli(capsys, "generate", "--model", str(d), "--prompt", "w5", "--max-tokens", "2",
                       "--device", "ane", "--json")
    assert rc == 0 and json.loads(out)["device"] == "cpu" and "no device pipeline" in err


def test_chat_uses_the_template_and_streams_replies(model_dir, capsys, monkeypatch, tmp_path):
    import io
    import shutil

    d, hf = model_dir
    chat_dir = tmp_path / "chat"
    shutil.copytree(d, chat_dir)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # words only: ids are the words
    (chat_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w6\n\nw7\n"))
    from anelm.generate.pipeline import DeviceRunner

    ran = []  # (position, tokens) of every prefill; decode runs one token at a time
    prefill = DeviceRunner.prefill
    monkeypatch.setattr(DeviceRunner, "prefill",
                        lambda self, ids, cache, **kw: ran.append((cache.length, list(ids))) or
                        prefill(self, ids, cache, **kw))
    rc, out, err = cli(capsys, "chat", "--model", str(chat_dir), "--temperature", "0", "--max-tokens", "4")
    first = hf_greedy(hf, [5, 6], 4)
    second_prompt = [5, 6] + first + [7]
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2
    assert lines[0] == " ".join(WORDS[i] for i in first)
    assert lines[1] == " ".join(WORDS[i] for i in hf_greedy(hf, second_prompt, 4))
    assert "template format" in err
    # the second turn continues the cache: the reply's last token (never decoded) and the new
    # line run, at the position after what the first turn left in the cache
    assert ran == [(0, [5, 6]), (len(second_prompt) - 2, second_prompt[-2:])]


@pytest.mark.parametrize("argv, code, message", [
    (["--model", "/nonexistent/model"], 1, "model not found: /nonexistent/model: expected an HF folder"),
    (["--model", "EMPTY"], 1, "no config.json in"),
    (["--model", "NOWEIGHTS"], 1, "no weights in"),
    (["--model", "BERT"], 1, "unsupported model_type 'bert'"),
    (["--prompt", " ".join(["w5"] * 70)], 1, "the prompt is 70 tokens, longer than the model's context of 64"),
    (["--temperature", "-1"], 2, "temperature must be >= 0"),
    (["--top-p", "0"], 2, r"top-p must be in \(0, 1\]"),
    (["--top-p", "1.5"], 2, r"top-p must be in \(0, 1\]"),
    (["--top-k", "-3"], 2, "top-k must be an integer >= 0"),
    (["--repetition-penalty", "0"], 2, "repetition-penalty must be > 0"),
    (["--max-tokens", "-1"], 2, "max-tokens must be an integer >= 0"),
    (["--max-tokens", "ten"], 2, "invalid int value"),
    (["--device", "gpu"], 2, "invalid choice"),
    (["--profile", "/nonexistent/profile.json"], 1, "chip profile '/nonexistent/profile.json' not found"),
    (["--frobnicate"], 2, "unrecognized arguments"),
])
def test_bad_input_is_one_line_error(model_dir, capsys, tmp_path, argv, code, message):
    import re
    import shutil

    d, _ = model_dir
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "NOWEIGHTS").mkdir()
    shutil.copy(d / "config.json", tmp_path / "NOWEIGHTS" / "config.json")
    (tmp_path / "BERT").mkdir()
    (tmp_path / "BERT" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    argv = [str(tmp_path / a) if a in ("EMPTY", "NOWEIGHTS", "BERT") else a for a in argv]
    if "--model" not in argv:
        argv = ["--model", str(d)] + argv
    rc, out, err = cli(capsys, "generate", *argv)
    assert rc == code and out == ""
    assert err.count("\n") == 1 and err.startswith("anelm: error: ") and re.search(message, err), err
