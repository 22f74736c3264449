"""`response_format` by constrained decoding: at each step, the tokens that cannot continue a
valid output get -inf logits, so any sampler picks a token that keeps the output valid.

    constraint = response_constraint(tokenizer, {"type": "json_object"})  # None for text
    logits = constraint(tokens, logits)   # a logits processor: disallowed ids -> -inf
    constraint.advance(token)             # feed the sampled token
    constraint.done                       # the output is complete: stop ("stop")

The masks come from llguidance (benchmarks/bench_constrain.py measures it against xgrammar and
outlines-core: it has no dependencies, compiles a schema in under a millisecond and handles
`json_object`'s recursive grammar). It is the optional extra `anelm[serve]`, imported only when a
request asks for JSON. Its tokenizer-level tables take a few tenths of a second to build, so they
are built once per tokenizer object and kept as long as that object lives.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from ..errors import AnelmError, UsageError

INSTALL = "pip install 'anelm[serve]'"
TYPES = ("text", "json_object", "json_schema")
# No free whitespace: a small model offered it tends to loop on newlines or spaces inside a
# structure; the separators are json.dumps' own, the spacing models saw most in training.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ResponseFormatError(UsageError):
    """A response_format the server cannot honour; `param` names the field (an HTTP 400)."""

    def __init__(self, param: str, problem: str):
        self.param = param
        super().__init__(f"{param}: {problem}")


class ConstraintError(AnelmError):
    """A token fed to a constraint that its mask did not allow."""


def response_constraint(tokenizer: Any, response_format: dict | None,
                        eos_ids: Sequence[int] = ()) -> Constraint | None:
    """The constraint for one request's `response_format` (OpenAI's shape), or None for text.

    `eos_ids`: the ids that end the output besides the tokenizer's EOS (the model's own, as
    `generate` stops on); each is allowed wherever the output may end."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ResponseFormatError("response_format", f"expected an object, got {_kind(response_format)}")
    kind = response_format.get("type")
    if kind not in TYPES:
        raise ResponseFormatError("response_format.type", f"expected one of {', '.join(TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    schema = {"type": "object"} if kind == "json_object" else _schema(response_format.get("json_schema"))
    param = "response_format" if kind == "json_object" else "response_format.json_schema.schema"
    llg = _library(kind)
    eos = [i for i in (getattr(tokenizer, "eos_id", None), *eos_ids) if i is not None]
    if not eos:
        raise ResponseFormatError("response_format", "the model's tokenizer has no EOS token to end the output with")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise ResponseFormatError(param, _first_line(e)) from None
    tables = _tables(tokenizer)
    matcher = llg.LLMatcher(tables, grammar, log_level=0)
    if matcher.is_error():
        raise ResponseFormatError(param, _first_line(matcher.get_error()))
    return Constraint(matcher, tokenizer.vocab_size, tables.eos_token, eos)


class Constraint:
    """One request's output state. `__call__` masks logits by the tokens fed to `advance` so far
    (its `tokens` argument is there to fit the LogitsProcessor shape, and is not read)."""

    def __init__(self, matcher: Any, vocab_size: int, end: int, eos_ids: Sequence[int]):
        # `end` is the library's one EOS; the mask's "may end here" allows each of eos_ids
        self.matcher, self.vocab_size, self.end = matcher, vocab_size, end
        self.eos_ids = [i for i in dict.fromkeys(eos_ids) if 0 <= i < vocab_size]
        self.bits = np.zeros((vocab_size + 31) // 32, np.int32)

    @property
    def done(self) -> bool:
        """True once the output is complete: nothing but EOS can follow (or EOS was fed)."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the ids that may come next."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        ok = np.unpackbits(self.bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)
        may_end, ok[self.end] = bool(ok[self.end]), False
        ok[self.eos_ids] = may_end
        return ok

    def __call__(self, tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        # ids past the tokenizer's vocabulary (a model's padded embedding rows) are never text
        n = min(self.vocab_size, logits.shape[-1])
        out = np.full_like(logits, -np.inf)
        out[:n] = np.where(self.allowed()[:n], logits[:n], -np.inf)
        return out

    def advance(self, token: int) -> None:
        """Feed the sampled token; an id the mask did not allow is a ConstraintError."""
        fed = self.end if token in self.eos_ids else int(token)
        if not 0 <= fed < self.vocab_size or not self.matcher.consume_token(fed):
            error = self.matcher.get_error() or f"id {token} is outside the vocabulary of {self.vocab_size}"
            raise ConstraintError(f"token {token} does not continue the response_format's output: "
                                  f"{_first_line(error)}")


def _schema(spec: Any) -> dict:
    """The JSON schema of a json_schema response_format, its fields checked as OpenAI's API does."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ResponseFormatError(where, f"expected an object with name and schema, got {_kind(spec)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ResponseFormatError(f"{where}.name", f"expected a non-empty string, got {_kind(name)}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ResponseFormatError(f"{where}.strict", f"expected true or false, got {_kind(spec['strict'])}")
    if not isinstance(spec.get("schema"), dict):
        raise ResponseFormatError(f"{where}.schema", f"expected a JSON Schema object, got {_kind(spec.get('schema'))}")
    return spec["schema"]  # strict or not, the output follows it: a constraint costs nothing more


def _library(kind: str) -> Any:
    try:
        import llguidance
    except ImportError:
        raise ResponseFormatError("response_format", f"{kind} needs the optional package llguidance: "
                                  f"{INSTALL}") from None
    return llguidance


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tables(tokenizer: Any) -> Any:
    """llguidance's tables for a tokenizer (its token bytes, EOS, the mask's slices), cached."""
    tables = _TABLES.get(tokenizer)
    if tables is None:
        hf = getattr(tokenizer, "tok", None)
        if not hasattr(hf, "to_str"):
            raise ResponseFormatError("response_format", "needs a tokenizer.json (HF tokenizers) "
                                      f"tokenizer; this model's is a {type(tokenizer).__name__}")
        import llguidance

        try:
            tables = llguidance.LLTokenizer(hf.to_str(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)
        except (ValueError, RuntimeError) as e:
            raise AnelmError(f"cannot build token masks for this tokenizer: {_first_line(e)}") from None
        _TABLES[tokenizer] = tables
    return tables


def _first_line(e: object) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"[:80]
