"""The built-in corpus, dataset loading and caching, batching and exact resume, bad input."""

import json
import time

import numpy as np
import pytest

from anelm.train import data as D
from anelm.train.data.corpus import EOT, SEPARATOR, generate_corpus, write_corpus
from anelm.train.errors import DataError


# ------------------------------------------------------------------------------ corpus

def test_corpus_is_deterministic_and_varied():
    a = generate_corpus(300_000, seed=1)
    assert a == generate_corpus(300_000, seed=1) and a != generate_corpus(300_000, seed=2)
    assert 300_000 <= len(a) < 302_000
    stories = a.strip().split(SEPARATOR)
    assert len(stories) > 200 and len(set(stories)) == len(stories)  # no story repeats
    words = set(a.split())
    assert 200 < len(words) < 2000  # a small vocabulary, but not a handful of words


def test_corpus_keeps_each_story_consistent():
    for story in generate_corpus(50_000, seed=3).strip().split(SEPARATOR)[:50]:
        hero = story.split("named ")[-1].split(".")[0] if "named " in story else None
        if hero and " " not in hero:
            assert f"{hero} felt very" in story  # the hero carries through the story


# ---------------------------------------------------------------------------- datasets

def decode_all(tok, ids):
    """Text of ids, special tokens included (anelm's decode drops them)."""
    return tok.tok.decode([int(i) for i in ids], skip_special_tokens=False)


@pytest.fixture
def corpus_file(tmp_path):
    return write_corpus(tmp_path / "stories.txt", 60_000, seed=0)


def test_text_file_trains_bpe_caches_tokens_and_reuses(tmp_path, corpus_file):
    run, cache = tmp_path / "run", tmp_path / "cache"
    ds = D.load_dataset(corpus_file, 32, run_dir=run, bpe_vocab_size=400, cache_dir=cache)
    assert ds.tokenizer_path == run / "tokenizer.json" and ds.tokenizer_path.exists()
    assert ds.tokens.dtype == np.uint16 and isinstance(ds.tokens, np.memmap)
    assert D.vocab_size_of(ds.tokenizer) <= 400
    text = corpus_file.read_text()
    assert decode_all(ds.tokenizer, ds.tokens) == text  # byte-level BPE is lossless
    eot = ds.tokenizer.tok.token_to_id(EOT)
    assert ds.tokenizer.eos_id == eot and np.count_nonzero(ds.tokens == eot) == text.count(EOT)
    assert len(ds.val) == round(0.05 * len(ds.tokens)) and len(ds.train) + len(ds.val) == len(ds.tokens)
    cached = list(cache.glob("*.u16"))
    assert len(cached) == 1
    again = D.load_dataset(corpus_file, 32, run_dir=run, cache_dir=cache)  # reuses both
    assert np.array_equal(again.tokens, ds.tokens) and list(cache.glob("*.u16")) == cached
    corpus_file.write_text(text + "One more line.\n")  # new content, new cache entry
    D.load_dataset(corpus_file, 32, run_dir=run, cache_dir=cache)
    assert len(list(cache.glob("*.u16"))) == 2


def test_folder_of_txt_files_and_given_tokenizer(tmp_path, corpus_file):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    text = corpus_file.read_text()
    (folder / "b.txt").write_text(text[: len(text) // 2])
    (folder / "sub" / "a.txt").write_text(text[len(text) // 2:])
    (folder / "ignored.md").write_text("not data")
    (folder / "empty.txt").write_text("")  # one empty file among others is harmless
    tok = D.train_bpe([corpus_file], 300, tmp_path / "tok.json")
    ds = D.load_dataset(folder, 16, tokenizer=tmp_path / "tok.json", cache_dir=tmp_path / "c")
    assert ds.tokenizer_path is None
    first = tok.encode(text[: len(text) // 2]).ids
    assert list(ds.tokens[: len(first)]) == first  # b.txt first: sorted by path
    assert "not data" not in decode_all(ds.tokenizer, ds.tokens)


class CharTokenizer:
    """A minimal foreign tokenizer: encode(text) without keywords, vocab_size, big ids."""

    vocab_size = 70_000

    def encode(self, text):
        return [ord(c) + 65_000 for c in text]


def test_duck_typed_tokenizer_object_and_uint32_cache(tmp_path, corpus_file):
    ds = D.load_dataset(corpus_file, 16, tokenizer=CharTokenizer(), cache_dir=tmp_path / "c")
    text = corpus_file.read_text()
    assert ds.tokens.dtype == np.uint32 and len(ds.tokens) == len(text)
    assert "".join(chr(int(i) - 65_000) for i in ds.tokens[:100]) == text[:100]
    assert len(list((tmp_path / "c").glob("*.u32"))) == 1


def test_pretokenized_bin(tmp_path):
    ids = np.arange(1000, dtype="<u2") % 500
    (tmp_path / "data.bin").write_bytes(ids.tobytes())
    ds = D.load_dataset(tmp_path / "data.bin", 64, cache_dir=tmp_path / "c")
    assert np.array_equal(ds.tokens, ids) and ds.tokenizer is None
    ds.check_vocab(500)
    with pytest.raises(DataError, match="token id 499 but the model's vocab_size is 499"):
        ds.check_vocab(499)


def _one_line_error(call, match):
    with pytest.raises(DataError, match=match) as e:
        call()
    assert "\n" not in str(e.value)


def test_bad_inputs_give_one_line_errors(tmp_path, corpus_file):
    load = lambda p, **kw: D.load_dataset(p, 32, run_dir=tmp_path / "r",  # noqa: E731
                                          cache_dir=tmp_path / "c", **kw)
    _one_line_error(lambda: load(tmp_path / "missing.txt"), "does not exist")
    (tmp_path / "empty.txt").write_bytes(b"")
    _one_line_error(lambda: load(tmp_path / "empty.txt"), "is empty")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    _one_line_error(lambda: load(tmp_path / "latin1.txt"), r"not UTF-8 \(byte 0xe9 at offset 3\)")
    (tmp_path / "img.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    _one_line_error(lambda: load(tmp_path / "img.txt"), "looks binary")
    (tmp_path / "nothing").mkdir()
    _one_line_error(lambda: load(tmp_path / "nothing"), "holds no .txt files")
    for name in ("a.txt", "b.txt"):
        (tmp_path / "nothing" / name).write_bytes(b"")
    _one_line_error(lambda: load(tmp_path / "nothing"), "holds only empty files")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    _one_line_error(lambda: load(tmp_path / "odd.bin"), "expected an even count")
    (tmp_path / "short.txt").write_text("Once upon a time.")
    _one_line_error(lambda: load(tmp_path / "short.txt"), r"expected at least 66 \(seq_len \+ 1")
    _one_line_error(lambda: load(corpus_file, tokenizer=tmp_path / "nope.json"), "does not exist")


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, corpus_file):
    ds = D.load_dataset(corpus_file, 32, run_dir=tmp_path / "r", bpe_vocab_size=400,
                        cache_dir=tmp_path / "c")
    n = D.vocab_size_of(ds.tokenizer)
    ds.check_vocab(n)
    _one_line_error(lambda: ds.check_vocab(n - 1), f"tokenizer has {n} ids but the model's vocab_size")


def test_unigram_entropy():
    assert D.unigram_entropy(np.array([0, 1, 2, 3])) == pytest.approx(np.log(4))
    assert D.unigram_entropy(np.array([5, 5, 5])) == 0.0


# ----------------------------------------------------------------------------- batches

def test_batches_are_shifted_windows_and_seeded():
    tokens = np.arange(10_000, dtype=np.uint16)
    b = D.Batcher(tokens, 4, 32, seed=7)
    x, y = b.next()
    assert x.shape == y.shape == (4, 32) and x.dtype == np.int64
    assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(y[:, -1], x[:, -1] + 1)
    assert np.array_equal(D.Batcher(tokens, 4, 32, seed=7).next()[0], x)
    assert not np.array_equal(D.Batcher(tokens, 4, 32, seed=8).next()[0], x)
    for _ in range(200):  # windows never run off the end
        assert b.next()[1].max() <= 9999


def test_batcher_resume_is_exact_through_json():
    tokens = np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16)
    straight = D.Batcher(tokens, 3, 16, seed=1)
    ref = [straight.next() for _ in range(10)]
    first = D.Batcher(tokens, 3, 16, seed=1)
    for _ in range(4):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # as stored in checkpoint metadata
    resumed = D.Batcher(tokens, 3, 16, seed=999)
    resumed.load_state_dict(state)
    assert resumed.drawn == 4
    for want in ref[4:]:
        got = resumed.next()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_eval_batches_are_fixed_and_cover_the_split():
    val = np.arange(1000, dtype=np.uint16)
    a, b = D.eval_batches(val, 4, 50, max_batches=3), D.eval_batches(val, 4, 50, max_batches=3)
    assert len(a) == 3 and all(x.shape == (4, 50) for x, _ in a)
    assert all(np.array_equal(p[0], q[0]) for p, q in zip(a, b))
    assert a[0][0][0, 0] == 0 and a[-1][1][-1, -1] == 999  # first and last token reached
    with pytest.raises(DataError, match="validation split has 10 tokens"):
        D.eval_batches(val[:10], 4, 50)


def test_no_data_means_the_builtin_corpus(tmp_path):
    ds = D.load_dataset(None, 128, run_dir=tmp_path / "run", cache_dir=tmp_path / "c")
    assert ds.source == "the built-in corpus" and (tmp_path / "run" / "tokenizer.json").exists()
    head = decode_all(ds.tokenizer, ds.tokens[:2000])
    assert len(head) > 4000 and generate_corpus().startswith(head)
    assert 50_000 < len(ds.tokens) < 400_000 and D.vocab_size_of(ds.tokenizer) <= 1024
    assert 3.0 < D.unigram_entropy(ds.tokens) < 7.0  # the bar the default run must beat by 30 %
