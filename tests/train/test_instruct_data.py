"""Instruction data (docs/fine-tuning.md): JSONL records to examples whose counted tokens match HF's
chat template on the real SmolLM2 tokenizer, one-line `FILE:LINE` errors, first-fit packing, and
the example batcher's epochs, exact resume and sharding."""

import copy
import json
from collections.abc import Mapping

import numpy as np
import pytest

from anelm.models.tokenizer.base import Tokenizer
from anelm.train.data import unigram_entropy
from anelm.train.errors import DataError
from anelm.train.steps.cpu_ops import IGNORE
from anelm.train.data.instruct import (Example, encode_record, is_jsonl, jsonl_splits, load_examples,
                                  read_records)
from instruct_tiny import CONVERSATIONS
from anelm.train.data.packing import ExampleBatcher, counted_entropy, counted_total, eval_batches, fit, sequences


class CharTok(Tokenizer):
    """ids are 3 + each UTF-8 byte; encode adds BOS 1; EOS 2; no template (the plain format)."""

    def __init__(self):
        super().__init__(bos_id=1, eos_id=2)

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [3 + b for b in text.encode()]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode()


def write(tmp_path, rows, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


# --------------------------------------------------------------------- HF's oracle

def hf_chat(hf_tok, messages, generation_prompt):
    out = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_counted_chat_tokens_are_hfs_answer_and_end_of_turn(smollm, smollm_hf, k):
    _, _, tok = smollm
    _, hf_tok = smollm_hf
    messages = CONVERSATIONS[k]
    full, prefix = hf_chat(hf_tok, messages, False), hf_chat(hf_tok, messages[:-1], True)
    assert full[:len(prefix)] == prefix  # the oracle's own premise
    ids, counted = encode_record("messages", {"messages": messages}, tok)
    assert ids.tolist() == full
    assert ids[counted].tolist() == full[len(prefix):] and not counted[:len(prefix)].any()
    assert hf_tok.decode(ids[counted]) == messages[-1]["content"] + "<|im_end|>\n"
    ids, counted = encode_record("messages", {"messages": messages}, tok, train_on_prompt=True)
    assert ids.tolist() == full and counted.tolist() == [False] + [True] * (len(full) - 1)


def test_counted_completion_and_text_tokens_match_hfs_tokenizer(smollm, smollm_hf):
    _, _, tok = smollm
    _, hf_tok = smollm_hf
    enc = lambda s, special=True: hf_tok(s, add_special_tokens=special)["input_ids"]  # noqa: E731
    eos = hf_tok.eos_token_id
    assert eos == tok.eos_id
    prompt, completion = "Translate to French: good morning", " Bonjour."
    ids, counted = encode_record("prompt", {"prompt": prompt, "completion": completion}, tok)
    assert ids.tolist() == enc(prompt) + enc(completion, False) + [eos]
    assert ids[counted].tolist() == enc(completion, False) + [eos]
    ids, counted = encode_record("text", {"text": "A plain sentence, with no roles."}, tok)
    assert ids.tolist() == enc("A plain sentence, with no roles.") + [eos]
    assert counted.tolist() == [False] + [True] * (len(ids) - 1)


def test_the_plain_format_keeps_the_prefix_rule(smollm):
    plain = copy.copy(smollm[2])
    plain.chat_template = None  # a model without a template: User:/Assistant: lines
    assert plain.chat_format() == "plain"
    ids, counted = encode_record("messages", {"messages": CONVERSATIONS[2]}, plain)
    assert plain.decode(ids[counted].tolist()) == " " + CONVERSATIONS[2][-1]["content"]


# --------------------------------------------------------------------------- files

def test_shapes_extra_keys_blank_lines_and_line_numbers(tmp_path):
    p = write(tmp_path, [{"messages": CONVERSATIONS[0], "id": 3}, "", "   ", {"messages": CONVERSATIONS[1]}])
    shape, records = read_records(p)
    assert shape == "messages" and [line for line, _ in records] == [1, 4] and records[0][1]["id"] == 3
    p = write(tmp_path, [{"prompt": "Q: hi\nA:", "completion": " yo", "source": "x"}])
    shape, examples = load_examples(p, CharTok())
    e, = examples
    assert shape == "prompt" and e.line == 1
    assert CharTok().decode(e.ids[e.counted].tolist()) == " yo" and e.ids[-1] == 2  # the EOS counts
    p = write(tmp_path, [{"text": "ab"}, {"text": ""}])
    _, (a, b) = load_examples(p, CharTok())
    assert a.ids.tolist() == [1, 100, 101, 2] and a.counted.tolist() == [False, True, True, True]
    assert b.ids.tolist() == [1, 2] and b.predictions == 1
    p = write(tmp_path, [{"prompt": "q", "completion": ""}])
    _, (e,) = load_examples(p, CharTok())
    assert e.ids.tolist() == [1, 116, 2] and e.counted.tolist() == [False, False, True]


def test_splits_of_a_folder_and_of_a_file(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "valid.jsonl").write_text("{}\n")
    assert is_jsonl(tmp_path) and is_jsonl(tmp_path / "train.jsonl") and is_jsonl(tmp_path / "missing.jsonl")
    assert jsonl_splits(tmp_path) == {"train": tmp_path / "train.jsonl", "valid": tmp_path / "valid.jsonl"}
    assert jsonl_splits(tmp_path / "valid.jsonl") == {"train": tmp_path / "valid.jsonl"}
    (tmp_path / "t.txt").write_text("x")
    assert not is_jsonl(tmp_path / "t.txt") and not is_jsonl(tmp_path / "sub")
    (tmp_path / "sub").mkdir()
    with pytest.raises(DataError, match="has no train.jsonl"):
        jsonl_splits(tmp_path / "sub")


USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "yo"}
BAD = [  # (lines, the line named, what the message says)
    ([], 1, "no records (the file is empty)"),
    (["", "  "], 1, "no records"),
    ([{"text": "a"}, '{"text": "b"'], 2, "not valid JSON (Expecting ',' delimiter at column 13)"),
    ([{"text": "a"}, "[1, 2]"], 2, "found a list; expected a JSON object"),
    (["{'text': 'a'}"], 1, "not valid JSON"),
    ([{"id": 1, "input": "x"}], 1, "a record with keys {'id', 'input'}; expected {\"messages\""),
    ([{"messages": [USER, ANSWER]}, {"text": "b"}], 2,
     "a record with keys {'text'} in a messages file (the first record decides the file's shape); "
     "expected 'messages'"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], 2, "in a prompt/completion file; expected 'prompt' and 'completion'"),
    ([{"text": 3}], 1, "'text' is a number; expected a string"),
    ([{"prompt": "a", "completion": None}], 1, "'completion' is null; expected a string"),
    ([{"messages": []}], 1, "'messages' is an empty list; expected a non-empty list"),
    ([{"messages": {"role": "user"}}], 1, "'messages' is an object"),
    ([{"messages": [USER, ANSWER]}, {"messages": ["hi", ANSWER]}], 2, "messages[0] is a string"),
    ([{"messages": [{"role": "robot", "content": "x"}, ANSWER]}], 1,
     "messages[0] has role 'robot'; expected one of system, user, assistant"),
    ([{"messages": [{"content": "x"}, ANSWER]}], 1, "messages[0] has no role"),
    ([{"messages": [USER, {"role": "assistant"}]}], 1, "messages[1] has no content; expected a string"),
    ([{"messages": [USER, {"role": "assistant", "content": ["x"]}]}], 1, "messages[1] has a list as content"),
    ([{"messages": [USER, ANSWER]}, {"messages": [USER, ANSWER, USER]}], 2,
     "the last turn is the user's; expected the assistant's"),
]


@pytest.mark.parametrize("rows, line, says", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, rows, line, says):
    p = write(tmp_path, rows)
    with pytest.raises(DataError) as e:
        read_records(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{line}: ") and says in msg and "\n" not in msg


def test_missing_file_and_bad_bytes(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "none.jsonl")
    p = tmp_path / "latin.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=f"^{p}:2: not UTF-8"):
        read_records(p)
    p.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\n{"text": "b\xe2\x80\xa8c"}\n')  # a BOM, CRLF, a raw U+2028
    assert read_records(p) == ("text", [(1, {"text": "a"}), (3, {"text": "b\u2028c"})])


def test_a_template_that_rewrites_earlier_turns_names_the_line(tmp_path):
    class Rewriting(CharTok):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            body = "".join(m["content"] for m in messages)
            return self.encode(body.upper() if not add_generation_prompt else body + ">")

    p = write(tmp_path, [{"messages": [USER, ANSWER]}, {"messages": [USER, ANSWER]}])
    with pytest.raises(DataError, match=f"^{p}:1: the chat template renders the earlier turns differently"):
        load_examples(p, Rewriting())
    _, examples = load_examples(p, Rewriting(), train_on_prompt=True)  # no prefix needed
    assert len(examples) == 2


# ------------------------------------------------------------------------- packing

def ex(n, answer=None, line=0, first=10):
    """An example of n tokens (first, first+1, ...), the last `answer` of them counted (all but
    the first by default)."""
    counted = np.zeros(n, bool)
    counted[max(1, n - (n - 1 if answer is None else answer)):] = True
    return Example(np.arange(first, first + n, dtype=np.int64), counted, line)


def test_fit_cuts_to_seq_len_plus_one():
    out, cut = fit([ex(5), ex(9), ex(10), ex(12, answer=4)], 8)  # 9 tokens: 8 predictions, no cut
    assert cut == 2 and [len(e.ids) for e in out] == [5, 9, 9, 9]
    assert out[3].counted.sum() == 1  # the answer's first token survives the cut
    assert fit(out, 8)[1] == 0


def test_first_fit_packing_positions_and_ignore():
    examples = [ex(7, first=100), ex(6, first=200), ex(3, answer=1, first=300), ex(4, first=400)]
    x, y, pos = sequences(examples, 8, pack=True)
    # 6, 5, 2 and 3 predictions: 2 fills row 0 (6 + 2), 3 fits the 3 slots row 1 has left
    assert x.tolist() == [[100, 101, 102, 103, 104, 105, 300, 301], [200, 201, 202, 203, 204, 400, 401, 402]]
    assert y.tolist() == [[101, 102, 103, 104, 105, 106, IGNORE, 302],
                          [201, 202, 203, 204, 205, 401, 402, 403]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]]
    x, y, pos = sequences([ex(4), ex(3, answer=0), ex(1)], 8, pack=True)  # ex(1) predicts nothing
    assert x.shape == (1, 8) and x[0, 5:].tolist() == [0, 0, 0]
    assert y[0].tolist() == [11, 12, 13, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]
    assert pos[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]  # the padding is a segment of its own


def test_without_packing_one_example_per_sequence():
    x, y, pos = sequences([ex(3), ex(10), ex(1)], 6, pack=False)
    assert pos is None and x.shape == (2, 6)
    assert x.tolist() == [[10, 11, 0, 0, 0, 0], [10, 11, 12, 13, 14, 15]]
    assert y.tolist() == [[11, 12] + [IGNORE] * 4, [11, 12, 13, 14, 15, 16]]


def rand_examples(n, seed=0):
    rng = np.random.default_rng(seed)
    return [ex(int(rng.integers(2, 14)), answer=int(rng.integers(0, 4)), line=i + 1, first=20 * i)
            for i in range(n)]


def test_counted_total_and_entropy():
    examples = rand_examples(30)
    x, y, _ = sequences(examples, 16, pack=True)
    assert counted_total(examples) == (y != IGNORE).sum()
    assert counted_entropy(examples) == pytest.approx(unigram_entropy(y[y != IGNORE]))


def draws(batcher, n):
    return [batcher.draw() for _ in range(n)]


def same(a, b):
    return all(np.array_equal(p.x, q.x) and np.array_equal(p.y, q.y) and p.counted == q.counted and
               (p.positions is None) == (q.positions is None) and
               (p.positions is None or np.array_equal(p.positions, q.positions)) for p, q in zip(a, b))


@pytest.mark.parametrize("pack", [True, False])
def test_batcher_is_seeded_rolls_over_epochs_and_resumes_exactly(pack):
    examples = rand_examples(40)
    a, b = ExampleBatcher(examples, 3, 16, seed=5, pack=pack), ExampleBatcher(examples, 3, 16, seed=5, pack=pack)
    m0, m1 = len(a.epoch_sequences(0)[0]), len(a.epoch_sequences(1)[0])  # packed, the orders differ in rows
    n = (m0 + m1) // 3 + 1  # draws that run into a third epoch
    first = draws(a, n)
    assert same(first, draws(b, n))
    assert not same(first, draws(ExampleBatcher(examples, 3, 16, seed=6, pack=pack), n))
    assert all(batch.counted == (batch.y != IGNORE).sum() for batch in first)  # one rank: its rows are global
    assert all((batch.positions is not None) == pack for batch in first)
    assert a.drawn == n and a.epoch == 2 and a.cursor == 3 * n - m0 - m1
    rows = np.concatenate([batch.x for batch in first])
    assert np.array_equal(rows[:m0], a.epoch_sequences(0)[0])  # epoch 0 whole, in its order
    assert np.array_equal(rows[m0:m0 + m1], a.epoch_sequences(1)[0])  # then epoch 1's
    assert not np.array_equal(a.epoch_sequences(0)[0][:3], a.epoch_sequences(1)[0][:3])
    state = json.loads(json.dumps(a.state_dict()))
    straight = draws(a, 7)
    resumed = ExampleBatcher(examples, 3, 16, seed=5, pack=pack)
    resumed.load_state_dict(state)
    assert same(straight, draws(resumed, 7)) and resumed.drawn == n + 7


def test_two_ranks_together_are_one_rank_with_double_batch():
    examples = rand_examples(50, seed=1)
    one = draws(ExampleBatcher(examples, 4, 16, seed=2), 9)
    ranks = [draws(ExampleBatcher(examples, 2, 16, seed=2, shard=(r, 2)), 9) for r in (0, 1)]
    for k, whole in enumerate(one):
        r0, r1 = ranks[0][k], ranks[1][k]
        assert r0.x.shape == (2, 16) and r0.counted == r1.counted == whole.counted
        assert np.array_equal(np.concatenate([r0.x, r1.x]), whole.x)
        assert np.array_equal(np.concatenate([r0.y, r1.y]), whole.y)
        assert np.array_equal(np.concatenate([r0.positions, r1.positions]), whole.positions)


def test_a_set_with_nothing_to_predict_is_refused():
    with pytest.raises(DataError, match="no record of 2 or more tokens"):
        ExampleBatcher([ex(1), ex(1)], 2, 8, seed=0)
    with pytest.raises(DataError, match="no counted token"):
        ExampleBatcher([ex(5, answer=0)], 2, 8, seed=0)
    with pytest.raises(DataError, match="no counted target"):
        eval_batches([ex(5, answer=0)], 2, 8)


@pytest.mark.parametrize("world, pack", [(1, True), (2, True), (3, False)])
def test_eval_batches_cover_every_counted_target_once(world, pack):
    examples = rand_examples(23, seed=3)
    shards = [eval_batches(examples, 2, 16, shard=(r, world), pack=pack) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of batches
    seen = []
    for k in range(len(shards[0])):
        batches = [s[k] for s in shards]
        assert all(b.x.shape == (2, 16) and b.counted == batches[0].counted for b in batches)
        assert batches[0].counted == sum(int((b.y != IGNORE).sum()) for b in batches)
        assert all((b.positions is None) != pack for b in batches)
        seen += [t for b in batches for t in b.y[b.y != IGNORE].tolist()]
    # the ids are distinct per example (first = 20 i), so equal multisets mean each target once
    assert sorted(seen) == sorted(t for e in examples for t in e.ids[e.counted].tolist())
    x, _, _ = sequences(examples, 16, pack)
    assert np.array_equal(np.concatenate([b.x for k in range(len(shards[0])) for b in (s[k] for s in shards)])[:len(x)], x)
