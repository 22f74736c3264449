"""MIL literals -> numpy values, shared by both readers of `parser` (grammar in mil.lark).

Literals become numpy arrays of their declared dtype and shape. The grammar's callbacks
(`parser_grammar`) report errors at their token; `FAST` gives the hand-written reader
(`parser_fast`) the same conversions, raising NotFast wherever a callback would report.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

from .program import NUMPY_DTYPES, SUBBYTE_BITS, BlobRef, Literal, Program, TensorType
from .program import int_range, storage_dtype
from .parser_fast import NotFast

if TYPE_CHECKING:
    from lark import Token

KNOWN_DTYPES = frozenset(NUMPY_DTYPES) | {"string"} | frozenset(SUBBYTE_BITS)
_FLOATS = ("fp16", "fp32")
_VERSION = re.compile(r"\d+(\.\d+)?")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}
_TYPE_PARTS = re.compile(r"tensor\s*<\s*(\w+)\s*,\s*\[(.*)\]\s*>", re.S)
_SCALAR_PARTS = re.compile(r"(\w+)\(\s*(.*?)\s*\)$", re.S)
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
# The spellings of NUMBER, HEXFLOAT and FLOATWORD in mil.lark, for the elements of a list.
_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_HEXFLOAT = r"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)[pP][+-]?\d+"
_WORDS = {"float": rf"{_HEXFLOAT}|{_NUMBER}|[+-]?(?:inf|nan)", "int": r"[+-]?\d+", "bool": "true|false"}
_EXPECTED = {"float": "a number", "int": "an integer", "bool": "true or false"}
_ELEMENT_OF = {k: re.compile(w) for k, w in _WORDS.items()}
_LIST_OF = {k: re.compile(rf"\s*(?:{w})\s*(?:,\s*(?:{w})\s*)*") for k, w in _WORDS.items()}
_ELEMENT = re.compile(r'"(?:[^"\\\n]|\\.)*"|[^,\s\[\]][^,\[\]]*')  # one list element, with its span


class _Fail(Exception):
    """Raised inside grammar callbacks; `parse` turns it into a MILSyntaxError with the source name."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


def _fail_at(tok: Token, message: str, offset: int = 0) -> _Fail:
    """An error at `offset` characters into token `tok` (tokens such as LIST may span lines)."""
    head = str(tok)[:offset]
    nl = head.rfind("\n")
    line = tok.line + head.count("\n")
    column = tok.column + offset if nl < 0 else offset - nl
    return _Fail(message, line, column)


# --------------------------------------------------------------------------- literal values


def _dtype(name: str, tok: Token, offset: int = 0) -> str:
    if name not in KNOWN_DTYPES:
        raise _fail_at(tok, f"unknown dtype '{name}'; expected one of {', '.join(sorted(KNOWN_DTYPES))}", offset)
    return name


def _unquote(s: str) -> str:
    if "\\" not in s:  # the common case, at slicing speed
        return s[1:-1]
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), s[1:-1])


def _kind(dtype: str) -> str:
    return "float" if dtype in _FLOATS else dtype if dtype in ("bool", "string") else "int"


def _element(dtype: str, s: str):
    """One literal element as a Python value of `dtype`; ValueError says what was expected."""
    s, kind = s.strip(), _kind(dtype)
    if kind == "string":
        if not _STRING.fullmatch(s):
            raise ValueError(f"expected a quoted string, found '{s}'")
        return _unquote(s)
    if not _ELEMENT_OF[kind].fullmatch(s):
        raise ValueError(f"expected {_EXPECTED[kind]} for {dtype}, found '{s}'")
    if kind == "bool":
        return s == "true"
    if kind == "float":
        return float.fromhex(s) if "x" in s.lower() else float(s)
    v, (lo, hi) = int(s), int_range(dtype)
    if not lo <= v <= hi:
        raise ValueError(f"{dtype} value {v} is out of range; expected [{lo}, {hi}]")
    return v


def _fast_values(dtype: str, inner: str) -> np.ndarray | list | None:
    """All elements of a list body at numpy speed (inline masks run to 64k elements).

    None means "take the slow path", which converts element by element and names the first
    bad one with its position.
    """
    kind = _kind(dtype)
    if not inner.strip():
        return []
    if kind == "string" or not _LIST_OF[kind].fullmatch(inner):
        return None
    parts = inner.split(",")
    if kind == "bool":
        return np.array([p.strip() == "true" for p in parts])
    if kind == "float":
        return None if "x" in inner.lower() else np.array(parts, dtype=np.float64)  # hex floats: slow path
    try:
        values = np.array(parts, dtype=np.int64)
    except OverflowError:
        return None
    lo, hi = int_range(dtype)
    return values if lo <= values.min() and values.max() <= hi else None


def _array(dtype: str, values, shape: tuple[int, ...]):
    if dtype == "string":
        return values[0] if shape == () else np.array(values, dtype=object).reshape(shape)
    if dtype not in _FLOATS:
        return np.array(values, dtype=storage_dtype(dtype)).reshape(shape)  # in range: checked
    with np.errstate(over="ignore"):  # fp16(1e5) is +inf, as the hardware rounds it
        return np.array(values, dtype=storage_dtype(dtype)).reshape(shape)


def _list_elements(tok: Token, start: int, end: int) -> list[tuple[str, int]]:
    """The elements of the flat list `tok[start:end]` with their offsets into the token."""
    return [(m.group(), m.start()) for m in _ELEMENT.finditer(str(tok), start, end)]


def _tensor_type(tok: Token) -> TensorType:
    """A TENSOR_TYPE token, `tensor<fp16, [1, 64, 1, 32]>`."""
    m = _TYPE_PARTS.match(tok)
    dtype, dims = _dtype(m.group(1), tok, m.start(1)), []
    for text, off in _list_elements(tok, m.start(2), m.end(2)):
        if not text.strip().isdigit():
            raise _fail_at(tok, f"expected a non-negative integer dimension, found '{text.strip()}'", off)
        dims.append(int(text))
    return TensorType(dtype, tuple(dims))


def _scalar_literal(dtype: str, tok: Token, text: str, offset: int) -> Literal:
    try:
        value = _element(dtype, text)
    except ValueError as e:
        raise _fail_at(tok, str(e), offset) from None
    return Literal(TensorType(dtype, None), _array(dtype, [value], ()))


def _tensor_literal(ttype: TensorType, body: Token) -> Literal:
    shape = ttype.shape or ()
    start, end = (1, len(body) - 1) if body.type == "LIST" else (0, len(body))
    values = _fast_values(ttype.dtype, str(body)[start:end])
    if values is None:
        values = []
        for text, off in _list_elements(body, start, end):
            try:
                values.append(_element(ttype.dtype, text))
            except ValueError as e:
                raise _fail_at(body, str(e), off) from None
    if len(values) != ttype.numel:
        raise _fail_at(body, f"tensor<{ttype.dtype}, {list(shape)}> literal has {len(values)} elements; "
                             f"expected {ttype.numel}")
    return Literal(ttype, _array(ttype.dtype, values, shape))


def _blob_ref(ttype: TensorType, tok: Token, kwargs: dict) -> BlobRef:
    path, offset = kwargs.get("path"), kwargs.get("offset")
    if set(kwargs) != {"path", "offset"}:
        raise _fail_at(tok, f"BLOBFILE takes path and offset; found {', '.join(sorted(kwargs)) or 'nothing'}")
    if not (isinstance(path, Literal) and isinstance(path.value, str)):
        raise _fail_at(tok, "BLOBFILE path must be a string literal such as string(\"@model_path/weights/w.bin\")")
    if not (isinstance(offset, Literal) and offset.type.is_scalar and offset.type.dtype.startswith(("uint", "int"))):
        raise _fail_at(tok, "BLOBFILE offset must be an integer literal such as uint64(64)")
    return BlobRef(ttype, path.value, int(offset.value))


class _At(str):
    """Text with a position, as a lark Token has one."""

    line = column = 1


class _FastLiterals:
    """The literal conversions of the grammar callbacks, for `parser_fast`: the same values,
    and NotFast wherever a callback would report an error (lark then reports it)."""

    _BLOB = _At("BLOBFILE")  # _blob_ref's errors need a place; NotFast drops it

    @staticmethod
    def known_dtype(name: str) -> str:
        if name not in KNOWN_DTYPES:
            raise NotFast
        return name

    @staticmethod
    def version(text: str) -> str:
        if not _VERSION.fullmatch(text):
            raise NotFast
        return text

    @staticmethod
    def string(quoted: str) -> str:
        return _unquote(quoted)

    def scalar(self, dtype: str, text: str) -> Literal:
        dtype = self.known_dtype(dtype)
        try:
            return Literal(TensorType(dtype, None), _array(dtype, [_element(dtype, text)], ()))
        except ValueError:
            raise NotFast from None

    @staticmethod
    def tensor(ttype: TensorType, body: str) -> Literal:
        values = _fast_values(ttype.dtype, body)
        try:
            if values is None:
                values = [_element(ttype.dtype, m.group()) for m in _ELEMENT.finditer(body)]
        except ValueError:
            raise NotFast from None
        if len(values) != ttype.numel:
            raise NotFast
        return Literal(ttype, _array(ttype.dtype, values, ttype.shape or ()))

    def blob(self, ttype: TensorType, kwargs: dict) -> BlobRef:
        try:
            return _blob_ref(ttype, self._BLOB, kwargs)
        except _Fail:
            raise NotFast from None


FAST = _FastLiterals()
