"""Tokenizers against independent implementations, on the real files in ../shared.

- GPT-2 BPE from vocab.json + merges.txt (built on HF `tokenizers`) against a pure-Python
  byte-level BPE from `transformers`. transformers 5 backs `GPT2Tokenizer` with `tokenizers`,
  so its old slow class is gone; `ClvpTokenizer` is that same slow GPT-2 code (GPT-2 regex,
  bytes_to_unicode, rank-ordered merges) plus an English normalizer, which we switch off.
- llama2.c `tokenizer.bin` (our own encoder) against the `sentencepiece` library on the Llama-2 model.
- Chat templates against `transformers`' apply_chat_template.
"""

import json
import struct
import sys

import pytest
from helpers import shared_path
from hf_tiny import transformers

from anelm.models.errors import TokenizerError
from anelm.models.tokenizer import load_tokenizer
from anelm.models.tokenizer.base import HFTokenizer

TEXTS = [
    "Hello, world!", " Hello", "\n\n", "café", "$100.00", "Hello  ", "a",
    "I'm sure they'll've done it - don't ya think? We'd, you're, it's, I've",
    "CAPS'S DON'T 'quoted' \"double\"",
    "   leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\r\n  mixed \t \n runs",
    "x\n\n\ny    z", "\u00a0non-breaking\u2003em space\u3000ideographic",
    "1234567890 12 345 3.14159 1,000,000 2024-06-01T12:34:56Z",
    "Ünïcödé ñ 日本語のテキスト 한국어 русский текст Ελληνικά עברית العربية",
    "emoji 😀👍🏽 👨‍👩‍👧 🇺🇸 ✓ ∑ 𝔘𝔫𝔦",
    "code: def f(x):\n    return x**2  # comment",
    "Once upon a time there was a little girl named Lily.",
]


def shared(name: str):
    return shared_path("data", "tokenizers", name)


@pytest.fixture(scope="module")
def slow_gpt2():
    from transformers.models.clvp.tokenization_clvp import ClvpTokenizer

    class SlowGPT2(ClvpTokenizer):
        normalizer = property(lambda self: (lambda text: text))

    tok = SlowGPT2(str(shared("gpt2-vocab.json")), str(shared("gpt2-merges.txt")))
    return lambda text: [tok.encoder[t] for t in tok._tokenize(text)]


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(shared("gpt2-vocab.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_bpe_matches_slow_python_bpe(gpt2, slow_gpt2, text):
    ids = gpt2.encode(text)
    assert ids == slow_gpt2(text)
    assert gpt2.decode(ids) == text


def test_gpt2_goldens_and_specials(gpt2):
    # tiktoken's GPT-2 encodings, recorded in Orion's golden file (tests/tokenizer_golden.json)
    assert gpt2.encode("Hello, world!") == [15496, 11, 995, 0]
    assert gpt2.encode("$100.00") == [3, 3064, 13, 405]
    assert gpt2.encode("Hello  ") == [15496, 220, 220]
    assert (gpt2.vocab_size, gpt2.bos_id, gpt2.eos_id) == (50257, 50256, 50256)
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert gpt2.decode([64, 50256, 65]) == "ab"


def test_tokenizer_json_round_trip(gpt2, slow_gpt2, tmp_path):
    gpt2.save(tmp_path)
    tok = load_tokenizer(tmp_path)  # a folder: finds tokenizer.json
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        assert tok.encode(text) == slow_gpt2(text)


@pytest.fixture(scope="module")
def sp_pair():
    pytest.importorskip("sentencepiece")
    return load_tokenizer(shared("llama2c-tokenizer-32k.bin")), load_tokenizer(shared("llama2-tokenizer.model"))


@pytest.mark.parametrize("text", TEXTS + ["", " ", "<s> literal </s> <0x41>", "x" * 300, "▁already▁marked"])
def test_llama2c_bin_agrees_with_sentencepiece(sp_pair, text):
    l2c, sp = sp_pair
    ids = l2c.encode(text)
    assert ids == sp.encode(text)
    assert ids == [1] + sp.sp.encode(text)  # the library itself, BOS added by the post-processor choice
    assert l2c.decode(ids) == sp.decode(ids)


def test_llama2c_golden_and_save(sp_pair, tmp_path):
    l2c, _ = sp_pair
    assert l2c.encode("Once upon a time there was a little girl", add_special_tokens=False) == [
        9038, 2501, 263, 931, 727, 471, 263, 2217, 7826]  # Orion's SentencePiece golden (test_sp_tokenizer)
    assert (l2c.vocab_size, l2c.bos_id, l2c.eos_id) == (32000, 1, 2)
    l2c.save(tmp_path)
    assert (tmp_path / "tokenizer.bin").read_bytes() == shared("llama2c-tokenizer-32k.bin").read_bytes()


def test_llama2c_own_export_uses_spaces(tmp_path):
    """llama2.c's own export writes " " for "▁" and "\\n<s>\\n" for BOS."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += [b" ", b"h", b"i", b" h", b" hi"]
    body = b"".join(struct.pack("<fi", -float(i), len(p)) + p for i, p in enumerate(pieces))
    (tmp_path / "tokenizer.bin").write_bytes(struct.pack("<I", 3) + body)
    tok = load_tokenizer(tmp_path / "tokenizer.bin")
    assert tok.encode("hi hi") == [1, 263, 263] and tok.decode([1, 263, 263]) == "hi hi"
    assert tok.encode("é") == [1, 259, 3 + 0xC3, 3 + 0xA9]  # byte fallback
    assert tok.decode(tok.encode("é")) == "é"


def test_chat_template_matches_transformers(gpt2, tmp_path):
    template = ("{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}<|{{ m['role'] }}|>\n"
                "{{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}\n<|assistant|>\n{% endif %}")
    gpt2.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there \n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    ours = load_tokenizer(tmp_path)
    assert ours.chat_format() == "template" and ours.apply_chat_template(messages) == ref
    saved = tmp_path / "again"
    ours.save(saved)  # the template travels with the tokenizer (RUN folders)
    assert load_tokenizer(saved).apply_chat_template(messages) == ref


def test_plain_chat_format_without_template(gpt2):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                {"role": "user", "content": "?"}]
    assert gpt2.chat_format() == "plain"
    assert gpt2.decode(gpt2.apply_chat_template(messages)) == "User: Hi\nAssistant: Yo\nUser: ?\nAssistant:"


def test_bad_tokenizer_inputs(tmp_path, monkeypatch):
    with pytest.raises(TokenizerError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(TokenizerError, match="no tokenizer in .*: expected tokenizer.json, tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerError, match="GPT-2 BPE needs both vocab.json and merges.txt"):
        load_tokenizer(tmp_path / "vocab.json")
    (tmp_path / "tokenizer.bin").write_bytes(struct.pack("<Ifi", 8, 0.0, 20) + b"abc")
    with pytest.raises(TokenizerError, match="truncated tokenizer.bin at piece 0: expected 20 bytes, found 3"):
        load_tokenizer(tmp_path / "tokenizer.bin")
    (tmp_path / "x.vocab").write_text("")
    with pytest.raises(TokenizerError, match="unknown tokenizer file"):
        load_tokenizer(tmp_path / "x.vocab")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read tokenizer .*broken.json") as e:
        load_tokenizer(tmp_path / "broken.json")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if the optional package were absent
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match=r"needs the optional package sentencepiece: pip install"):
        load_tokenizer(tmp_path / "tokenizer.model")
