"""`response_format` by constrained decoding (anelm/generate/constrain.py) on the real SmolLM2
tokenizer (49,152 ids), driven by a fake model: seeded random logits over a padded vocabulary,
with a pull toward closing tokens that grows each step so that an output ends. Whatever the
model prefers, what comes out parses and follows the schema."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from anelm.generate import constrain
from anelm.generate.constrain import ConstraintError, ResponseFormatError, response_constraint

PADDED = 64  # the fake model's logits run past the tokenizer's vocabulary, as padded embeddings do
MAX_STEPS = 400
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def follows_schema(value) -> bool:
    """SCHEMA's rules, by hand (the suite has no JSON Schema validator)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "color", "tags"}
            and isinstance(value["name"], str)
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and value["color"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and all(isinstance(t, str) for t in value["tags"]))


@pytest.fixture(scope="module")
def tok(smollm):
    pytest.importorskip("llguidance")
    return smollm[2]


@pytest.fixture(scope="module")
def closers(tok) -> np.ndarray:
    """Ids of the tokens made only of '"', '}', ']' and ',' (the fake model's growing pull)."""
    texts = {a + b for a in ("", '"', "}", "]", ",") for b in ('"', "}", "]", ",")}
    ids = [tok.tok.token_to_id(t) for t in texts]
    return np.array(sorted(i for i in ids if i is not None))


def fake_run(constraint, tok, closers, seed: int, greedy: bool) -> tuple[list[int], np.ndarray]:
    """Sample through the constraint until done; (ids, the last masked logits)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for step in range(MAX_STEPS):
        logits = rng.standard_normal(tok.vocab_size + PADDED).astype(np.float32) * 3
        logits[tok.vocab_size:] += 100  # the padding rows would win every time, were they not masked
        logits[closers] += 0.2 * step
        masked = constraint(ids, logits)
        assert masked.shape == logits.shape and np.all(np.isneginf(masked[tok.vocab_size:]))
        if greedy:
            token = int(np.argmax(masked))
        else:
            p = np.exp(masked - masked.max())
            token = int(rng.choice(p.size, p=p / p.sum()))
        assert token < tok.vocab_size
        constraint.advance(token)
        ids.append(token)
        if constraint.done:
            return ids, constraint(ids, logits)
    raise AssertionError(f"not done after {MAX_STEPS} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_json_schema_output_parses_and_follows_the_schema(tok, closers, seed, greedy):
    ids, last = fake_run(response_constraint(tok, JSON_SCHEMA), tok, closers, seed, greedy)
    value = json.loads(tok.decode(ids))
    assert follows_schema(value), value
    # complete: only EOS may follow
    assert np.flatnonzero(np.isfinite(last)).tolist() == [tok.eos_id]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_gives_an_object(tok, closers, seed, greedy):
    ids, _ = fake_run(response_constraint(tok, {"type": "json_object"}), tok, closers, seed, greedy)
    assert isinstance(json.loads(tok.decode(ids)), dict)


def test_the_models_other_eos_ids_end_the_output_too(tok):
    c = response_constraint(tok, {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
                            eos_ids=[0])
    assert not np.isfinite(c([], np.zeros(tok.vocab_size, np.float32))[[0, tok.eos_id]]).any()
    c.advance(tok.tok.token_to_id("7"))
    assert not c.done  # more digits may come: the output ends when EOS is sampled
    allowed = np.flatnonzero(np.isfinite(c([], np.zeros(tok.vocab_size, np.float32))))
    assert {0, tok.eos_id} <= set(allowed.tolist())
    c.advance(0)
    assert c.done


def test_text_and_none_need_no_constraint_nor_the_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    assert response_constraint(None, None) is None
    assert response_constraint(None, {"type": "text"}) is None


def test_without_the_library_json_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ResponseFormatError, match=r"pip install 'anelm\[serve\]'") as e:
        response_constraint(object(), {"type": "json_object"})
    assert "\n" not in str(e.value) and e.value.param == "response_format"


def test_the_module_imports_without_the_library():
    code = "import sys, anelm.generate.constrain; assert 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("fmt, param, says", [
    ("json", "response_format", "expected an object"),
    ({}, "response_format.type", "expected one of text, json_object, json_schema"),
    ({"type": "xml"}, "response_format.type", "'xml'"),
    ({"type": "json_schema"}, "response_format.json_schema", "expected an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name", "string"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema", "JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": True}}, "response_format.json_schema.schema", ""),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict", "true or false"),
])
def test_a_bad_response_format_is_one_line_naming_the_field(fmt, param, says):
    with pytest.raises(ResponseFormatError) as e:
        response_constraint(None, fmt)
    assert e.value.param == param and str(e.value).startswith(param + ": ") and says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("schema, says", [({"type": "foo"}, "foo"), ({"type": "string", "pattern": "(("}, "regex"),
                                          ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum")])
def test_a_schema_the_library_rejects_is_one_line(tok, schema, says):
    with pytest.raises(ResponseFormatError) as e:
        response_constraint(tok, {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert e.value.param == "response_format.json_schema.schema" and says in str(e.value)
    assert "\n" not in str(e.value)


def test_a_token_the_mask_refused_is_an_error(tok):
    c = response_constraint(tok, {"type": "json_object"})
    with pytest.raises(ConstraintError) as e:
        c.advance(tok.tok.token_to_id("hello"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="outside the vocabulary"):
        response_constraint(tok, {"type": "json_object"}).advance(tok.vocab_size + 3)


def test_the_tokenizer_tables_are_built_once_per_tokenizer(tok):
    a = response_constraint(tok, {"type": "json_object"})
    b = response_constraint(tok, JSON_SCHEMA)
    assert a is not b and constrain._TABLES[tok] is constrain._tables(tok)


def test_a_tokenizer_without_tokenizer_json_is_one_line():
    pytest.importorskip("llguidance")

    class Plain:
        eos_id, vocab_size = 2, 10

    with pytest.raises(ResponseFormatError, match="needs a tokenizer.json") as e:
        response_constraint(Plain(), {"type": "json_object"})
    assert "\n" not in str(e.value)
