"""Instruction data (docs/fine-tuning.md): JSONL records to token examples with the targets that count.

    shape, examples = load_examples(Path("train.jsonl"), tok)
    examples[0].ids, examples[0].counted   # int64 [L], bool [L]

A file holds records of one shape, decided by its first record's keys:
    {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}   (chat template)
    {"prompt": str, "completion": str}
    {"text": str}
Extra keys beside the shape's are allowed (users carry ids, sources, ...).

`counted[j]` says token j is a scored target, predicted from ids[:j]. For `messages` that is
what follows the generation prompt of the last (assistant) turn; for `prompt`/`completion` the
completion and an EOS; for `text` every token. `train_on_prompt` counts every token. counted[0]
is always False: nothing predicts the first token.

Bad input is a `DataError` of one line, `FILE:LINE: what was found; what was expected`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import AnelmError
from ..errors import DataError

SHAPES = ("messages", "prompt", "text")  # named by the record key that decides the shape
ROLES = ("system", "user", "assistant")
SPLITS = ("train", "valid", "test")
_FORMS = '{"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}'
_KEYS = {"messages": ("messages",), "prompt": ("prompt", "completion"), "text": ("text",)}
_NAMES = {"messages": "messages", "prompt": "prompt/completion", "text": "text"}


@dataclass(frozen=True)
class Example:
    ids: np.ndarray      # int64 [L]: the record's tokens
    counted: np.ndarray  # bool [L]: counted[j] means ids[j] is a scored target; counted[0] is False
    line: int            # 1-based line of the record in its file (for messages and notices)

    @property
    def predictions(self) -> int:
        return int(self.counted.sum())


# ------------------------------------------------------------------------------ files

def is_jsonl(path: str | Path) -> bool:
    """A .jsonl file (present or not: reading it says what is wrong), or a folder with train.jsonl."""
    p = Path(path)
    return (p.suffix.lower() == ".jsonl" and not p.is_dir()) or (p / "train.jsonl").is_file()


def jsonl_splits(path: str | Path) -> dict[str, Path]:
    """{"train": p, "valid": p, "test": p} from a folder (valid and test only when present); a
    .jsonl file is {"train": file}."""
    p = Path(path)
    if not p.is_dir():
        return {"train": p}
    found = {name: p / f"{name}.jsonl" for name in SPLITS if (p / f"{name}.jsonl").is_file()}
    if "train" not in found:
        raise DataError(f"data folder {p} has no train.jsonl; expected train.jsonl and optionally "
                        "valid.jsonl and test.jsonl")
    return found


def read_records(path: Path) -> tuple[str, list[tuple[int, dict]]]:
    """(shape, [(line, record)]) of a JSONL file, every record checked; blank lines skipped."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist; expected a .jsonl file of {_FORMS}") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a folder; expected a .jsonl file or a folder holding train.jsonl") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM some editors write
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x}); expected UTF-8 JSON lines") from None
    shape, records = None, []
    for line, row in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not row.strip():
            continue
        record = _parse(path, line, row)
        shape = shape or _shape_of(path, line, record)
        _check(path, line, shape, record)
        records.append((line, record))
    if shape is None:
        raise DataError(f"{path}:1: no records (the file is empty); expected JSON lines of {_FORMS}")
    return shape, records


def _parse(path: Path, line: int, row: str) -> dict:
    try:
        record = json.loads(row)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{line}: not valid JSON ({e.msg} at column {e.colno}); "
                        "expected one JSON object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line}: found {_kind(record)}; expected a JSON object: {_FORMS}")
    return record


def _shape_of(path: Path, line: int, record: dict) -> str:
    for shape in SHAPES:
        if shape in record:
            return shape
    raise DataError(f"{path}:{line}: a record with keys {_keys(record)}; expected {_FORMS}")


def _check(path: Path, line: int, shape: str, record: dict) -> None:
    """Refuse a record that is not of the file's shape, or whose values are not what it needs."""
    where = f"{path}:{line}:"
    missing = [k for k in _KEYS[shape] if k not in record]
    if missing:
        first = " (the first record decides the file's shape)" if len(missing) == len(_KEYS[shape]) else ""
        raise DataError(f"{where} a record with keys {_keys(record)} in a {_NAMES[shape]} file{first}; "
                        f"expected {' and '.join(repr(k) for k in _KEYS[shape])}")
    if shape != "messages":
        for k in _KEYS[shape]:
            if not isinstance(record[k], str):
                raise DataError(f"{where} {k!r} is {_kind(record[k])}; expected a string")
        return
    turns = record["messages"]
    if not isinstance(turns, list) or not turns:
        found = "an empty list" if turns == [] else _kind(turns)
        raise DataError(f"{where} 'messages' is {found}; expected a non-empty list of "
                        '{"role": ..., "content": ...} turns')
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where} messages[{k}] is {_kind(turn)}; expected an object with role and content")
        if turn.get("role") not in ROLES:
            found = f"role {turn['role']!r}" if "role" in turn else "no role"
            raise DataError(f"{where} messages[{k}] has {found}; expected one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str):
            found = "no content" if "content" not in turn else f"{_kind(turn['content'])} as content"
            raise DataError(f"{where} messages[{k}] has {found}; expected a string")
    if turns[-1]["role"] != "assistant":
        raise DataError(f"{where} the last turn is the {turns[-1]['role']}'s; expected the assistant's "
                        "(its answer is what is learned)")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _keys(record: dict) -> str:
    return "{" + ", ".join(repr(k) for k in list(record)[:6]) + (", ..." if len(record) > 6 else "") + "}"


# ----------------------------------------------------------------------------- tokens

def encode_record(shape: str, record: dict, tok: Any, train_on_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [L], counted bool [L]) of one checked record."""
    if shape == "messages":
        turns = record["messages"]  # as given, extra keys too: what HF's apply_chat_template sees
        full = list(tok.apply_chat_template(turns, add_generation_prompt=False))
        prefix = [] if train_on_prompt else list(tok.apply_chat_template(turns[:-1], add_generation_prompt=True))
        if full[:len(prefix)] != prefix:
            raise DataError("the chat template renders the earlier turns differently once the last answer "
                            "is added; expected the conversation to extend its generation prompt")
        ids, start = full, len(prefix)
    elif shape == "prompt":
        prompt = list(tok.encode(record["prompt"]))  # the tokenizer's own BOS rule
        ids, start = prompt + list(tok.encode(record["completion"], add_special_tokens=False)), len(prompt)
        ids += _eos(tok)
    elif shape == "text":
        ids, start = list(tok.encode(record["text"])), 0
        ids += _eos(tok) if not ids or ids[-1] != tok.eos_id else []
    else:
        raise DataError(f"unknown record shape {shape!r}; expected one of {', '.join(SHAPES)}")
    counted = np.zeros(len(ids), dtype=bool)
    counted[0 if train_on_prompt else start:] = True
    counted[:1] = False  # the first token has no prediction
    return np.asarray(ids, dtype=np.int64), counted


def _eos(tok: Any) -> list[int]:
    # An EOS after a completion or a text teaches the model to stop there; mlx-lm and TRL append
    # it too. A tokenizer without one has nothing to add.
    return [] if tok.eos_id is None else [int(tok.eos_id)]


def load_examples(path: Path, tok: Any, train_on_prompt: bool = False) -> tuple[str, list[Example]]:
    """(shape, examples) of a JSONL file, in file order."""
    shape, records = read_records(path)
    return shape, encode_records(path, shape, records, tok, train_on_prompt)


def encode_records(path: Path, shape: str, records: list[tuple[int, dict]], tok: Any,
                   train_on_prompt: bool = False) -> list[Example]:
    """Examples of records `read_records` returned (a tokenizer or template error names the line)."""
    out = []
    for line, record in records:
        try:
            ids, counted = encode_record(shape, record, tok, train_on_prompt)
        except AnelmError as e:  # a template's raise_exception, a rewritten prefix: this record's fault
            raise DataError(f"{path}:{line}: {e}") from None
        out.append(Example(ids, counted, line))
    return out
