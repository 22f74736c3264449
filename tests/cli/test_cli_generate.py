"""`anelm generate` and `anelm chat` through `anelm.cli.main.main`, against HF greedy decoding."""

import json
import sys
import types

import pytest

import hf_tiny

pytest.importorskip("transformers")
torch = hf_tiny.torch

from anelm.cli.main import main  # noqa: E402

WORDS = hf_tiny.WORDS  # id i is word "w{i}"
KEYS = {"prompt_ids", "ids", "text", "prefill_ms", "decode_tokens_per_s", "device", "stream_scale"}  # docs/models.md


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


def fake_pipeline(monkeypatch) -> list[tuple[str, int | None]]:
    """Stands a recording pipeline module in for anelm.generate.pipeline: its runners are the
    CPU model reporting "emulator"; returns the (device, max_context) each build asked for."""
    from anelm.models.loading import build_model

    calls = []

    def build_runner(config, weights, device, max_context=None, profile=None, consume=False):
        calls.append((device, max_context))
        runner = build_model(config, weights)
        runner.device = "emulator"
        return runner

    monkeypatch.setitem(sys.modules, "anelm.generate.pipeline", types.SimpleNamespace(build_runner=build_runner))
    return calls


def test_device_hook_uses_the_pipeline_when_present(model_dir, capsys, monkeypatch):
    d, _ = model_dir
    calls = fake_pipeline(monkeypatch)
    rc, out, err = cli(capsys, "generate", "--model", str(d), "--prompt", "w5", "--max-tokens", "2",
                       "--device", "emulator", "--json")
    assert rc == 0 and [dev for dev, _ in calls] == ["emulator"] and json.loads(out)["device"] == "emulator"
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
    # decode passes predicted cheap: the held conversation is resumed, never prefilled anew (for a
    # model this small a bucket can be predicted faster than two steps: test_prefill_policy.py)
    monkeypatch.setattr(DeviceRunner, "pass_seconds", lambda self, kind, size: 1.0 if kind == "prefill" else 1e-6)
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
    (["--model", "LLAMAONLY"], 1, "llama config is missing vocab_size, hidden_size, intermediate_size, "
                                  "num_hidden_layers, num_attention_heads; expected every one of"),
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
    (tmp_path / "LLAMAONLY").mkdir()  # no weights either: the config is what to report
    (tmp_path / "LLAMAONLY" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    argv = [str(tmp_path / a) if a in ("EMPTY", "NOWEIGHTS", "BERT", "LLAMAONLY") else a for a in argv]
    if "--model" not in argv:
        argv = ["--model", str(d)] + argv
    rc, out, err = cli(capsys, "generate", *argv)
    assert rc == code and out == ""
    assert err.count("\n") == 1 and err.startswith("anelm: error: ") and re.search(message, err), err


def words_chat(tmp_path, model_dir, monkeypatch, stdin):
    """A copy of the word model whose chat template writes the messages' words only (so its
    prompt ids are the words), with `stdin` as the user's input; returns the folder and a list
    that gets, at each prefill, every id the model's cache then holds: the prompt it saw."""
    import shutil

    from anelm.generate.pipeline import DeviceRunner

    d, _ = model_dir
    chat_dir = tmp_path / "chat"
    shutil.copytree(d, chat_dir)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (chat_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    monkeypatch.setattr(sys, "stdin", stdin)
    held, fed = [], []
    prefill, decode = DeviceRunner.prefill, DeviceRunner.decode

    def watch_prefill(self, ids, cache, **kw):
        held[cache.length:] = list(ids)
        fed.append(list(held))
        return prefill(self, ids, cache, **kw)

    def watch_decode(self, token, cache):
        held[cache.length:] = [token]
        return decode(self, token, cache)

    monkeypatch.setattr(DeviceRunner, "prefill", watch_prefill)
    monkeypatch.setattr(DeviceRunner, "decode", watch_decode)
    return chat_dir, fed


def ids(text):
    return [WORDS.index(w) for w in text.split()]


def test_chat_drops_the_oldest_turns_and_refuses_only_a_message_that_cannot_fit(model_dir, capsys, monkeypatch,
                                                                                 tmp_path):
    import io

    system = "w3 w4"
    turns = [" ".join(f"w{i}" for i in range(start, start + 20)) for start in (10, 30, 50)]
    too_long = " ".join(["w5"] * 70)  # alone more than the context of 64
    stdin = io.StringIO("\n".join(turns + [too_long, "w7"]) + "\n")
    chat_dir, fed = words_chat(tmp_path, model_dir, monkeypatch, stdin)
    rc, out, err = cli(capsys, "chat", "--model", str(chat_dir), "--system", system, "--temperature", "0",
                       "--max-tokens", "4")
    replies = out.split("\n")[:-1]
    assert rc == 0 and len(replies) == 4, (out, err)  # every turn answered but the refused one
    r1, r2, r3, r4 = replies
    # the third turn would need 2 + 3·20 + its replies + 4 > 64: the first turn goes, the system stays
    assert fed == [ids(system + " " + turns[0]),
                   ids(f"{system} {turns[0]} {r1} {turns[1]}"),
                   ids(f"{system} {turns[1]} {r2} {turns[2]}"),
                   ids(f"{system} {turns[1]} {r2} {turns[2]} {r3} w7")]
    lines = err.replace("> ", "").splitlines()
    assert all(line.startswith("anelm: ") for line in lines if line), err
    dropped = [line for line in lines if "outgrew the context" in line]
    assert dropped == ["anelm: the conversation outgrew the context of 64 tokens: dropped the oldest 2 messages, "
                       "kept the system message and the newest 3"]
    refused = [line for line in lines if line.startswith("anelm: error: ")]
    assert refused == ["anelm: error: the message was not sent: it makes a prompt of 72 tokens, and with room "
                       "for a 4-token reply the context holds 64"]


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(model_dir, capsys, monkeypatch, tmp_path):
    import io

    stdin = io.TextIOWrapper(io.BytesIO(b"w5 \xff w6\nw7\n"), encoding="utf-8")  # a strict UTF-8 stdin
    chat_dir, fed = words_chat(tmp_path, model_dir, monkeypatch, stdin)
    rc, out, err = cli(capsys, "chat", "--model", str(chat_dir), "--temperature", "0", "--max-tokens", "2")
    assert rc == 0 and out.count("\n") == 1 and fed == [[7]], (out, err)
    errors = [line for line in err.replace("> ", "").splitlines() if "error" in line]
    assert errors == ["anelm: error: the message was not sent: byte 0xff at character 3 is not UTF-8; "
                      "expected UTF-8 text"]


def test_ctrl_c_stops_the_reply_not_the_chat(model_dir, capsys, monkeypatch, tmp_path):
    """Ctrl-C while a reply streams ends that reply (a newline, a notice) and the next
    message is answered, with the words the stopped reply got out kept in the conversation;
    Ctrl-C at the prompt ends the chat cleanly. A reply cut at --max-tokens says so."""
    import io

    from anelm.generate.pipeline import DeviceRunner

    class CtrlCAtTheEnd(io.StringIO):
        def readline(self, *a):
            return super().readline(*a) or (_ for _ in ()).throw(KeyboardInterrupt)

    chat_dir, fed = words_chat(tmp_path, model_dir, monkeypatch, CtrlCAtTheEnd("w5 w6\nw7\n"))
    decode, calls = DeviceRunner.decode, []

    def ctrl_c_at_the_second_decode(self, token, cache):
        calls.append(token)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return decode(self, token, cache)

    monkeypatch.setattr(DeviceRunner, "decode", ctrl_c_at_the_second_decode)
    rc, out, err = cli(capsys, "chat", "--model", str(chat_dir), "--temperature", "0", "--max-tokens", "3")
    stopped, second = out.split("\n")[:-1]
    assert rc == 0 and len(stopped.split()) == 2 and second, (out, err)  # two tokens got out
    assert fed == [[5, 6], [5, 6] + ids(stopped) + [7]]  # the stopped reply stays in the conversation
    notices = [line for line in err.replace("> ", "").splitlines() if line.startswith("anelm: reply")]
    assert notices[0] == "anelm: reply stopped (Ctrl-C); Ctrl-C at the prompt or Ctrl-D ends the chat"
    assert len(second.split()) == 3 and notices[1:] == ["anelm: reply cut at --max-tokens 3"], second
    assert err.endswith("> \n") and "interrupted" not in err


def test_ctrl_c_before_the_reply_begins_withdraws_the_message(model_dir, capsys, monkeypatch, tmp_path):
    import io

    from anelm.generate.pipeline import DeviceRunner

    chat_dir, fed = words_chat(tmp_path, model_dir, monkeypatch, io.StringIO("w5 w6\nw7\n"))
    prefill, calls = DeviceRunner.prefill, []

    def ctrl_c_in_the_first_prefill(self, ids, cache, **kw):
        calls.append(list(ids))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return prefill(self, ids, cache, **kw)

    monkeypatch.setattr(DeviceRunner, "prefill", ctrl_c_in_the_first_prefill)
    rc, out, err = cli(capsys, "chat", "--model", str(chat_dir), "--temperature", "0", "--max-tokens", "2")
    assert rc == 0 and out.startswith("\n") and out.count("\n") == 2, (out, err)
    assert calls == [[5, 6], [7]]  # the withdrawn message is not in the second prompt
    assert "the message was withdrawn" in err


def test_a_prompt_that_is_not_utf8_is_one_usage_error(model_dir, capsys):
    d, _ = model_dir
    rc, out, err = cli(capsys, "generate", "--model", str(d), "--prompt", "w5 \udcff")  # as sys.argv holds it
    assert rc == 2 and out == "" and err == ("anelm: error: generate: argument --prompt: byte 0xff at character 3 "
                                             "is not UTF-8; expected UTF-8 text\n")
    import subprocess

    r = subprocess.run([sys.executable, "-m", "anelm", "chat", "--model", str(d), "--system", b"w5 \xfe"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == ("anelm: error: chat: argument --system: byte 0xfe at character 3 "
                                              "is not UTF-8; expected UTF-8 text\n"), r.stderr


@pytest.mark.parametrize("prompt, max_tokens, context", [("w5", 2, 64), ("w5 w9 w22 w40", 60, 64),
                                                         ("w5 w9 w22 w40", 61, 128), ("w5", 3000, 4096)])
def test_generate_sizes_the_device_programs_to_its_prompt_and_new_tokens(model_dir, capsys, monkeypatch,
                                                                       prompt, max_tokens, context):
    """Decode reads its whole cache tier every token: a one-shot generation asks for the positions
    it can reach (rounded up to a power of two, at most MAX_CONTEXT), not the model's context."""
    d, _ = model_dir
    calls = fake_pipeline(monkeypatch)
    rc, _, _ = cli(capsys, "generate", "--model", str(d), "--prompt", prompt, "--max-tokens", str(max_tokens),
                   "--device", "emulator", "--json")
    assert rc == 0 and calls == [("emulator", context)]
