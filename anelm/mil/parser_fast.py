"""A hand-written recursive-descent reader of MIL text: the parser's fast path.

lark costs about 12 µs a token, and a decoder-layer kernel has some 2,300 tokens. This reader
matches the same grammar (mil.lark) with one compiled pattern per token kind, at the position
where the grammar expects it (what lark's contextual lexer does), and builds the same `Program`
with the same literal helpers. It never reports errors itself: on anything it does not accept
it raises `NotFast`, and `parser.parse` reads the text again with lark, whose messages name the
line, the column and what was expected. So it may reject more than the grammar, never less,
and whatever it accepts it must read exactly as lark does (tests/mil checks both paths agree).
"""

from __future__ import annotations

import re

from .program import Function, Literal, Program, Statement, TensorType, Var


class NotFast(Exception):
    """The fast path does not take this text; the lark grammar decides."""


_WS = r"(?:\s|//[^\n]*)*+"  # what the grammar ignores between tokens; every pattern starts with it
_END = re.compile(_WS + r"\Z")
_NAME = re.compile(_WS + r"([A-Za-z_][A-Za-z0-9_]*)")
_KEY = re.compile(_WS + r"([A-Za-z_][A-Za-z0-9_]*)\s*=")
_TENSOR_TYPE = re.compile(_WS + r"(tensor\s*<\s*([A-Za-z_][A-Za-z0-9_]*)\s*,\s*\[([^\[\]<>\"=;]*)\]\s*>)")
# a name (a variable) or a one-token scalar such as int32(1) or string("x"), before what ends it
_NAME_OR_SCALAR = re.compile(
    _WS + r"([A-Za-z_][A-Za-z0-9_]*)(?:\(\s*(\"(?:[^\"\\\n]|\\.)*\"|[^()\"\s]+)\s*\))?(?=\s*[,)\]])")
_SCALAR = re.compile(_WS + r"([A-Za-z_][A-Za-z0-9_]*)\(\s*(\"(?:[^\"\\\n]|\\.)*\"|[^()\"\s]+)\s*\)")
_NUMBER = re.compile(_WS + r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_LIST = re.compile(_WS + r"\[([^\[\]\"=;]*(?:\"(?:[^\"\\\n]|\\.)*\"[^\[\]\"=;]*)*)\]")
_STRING = re.compile(_WS + r"(\"(?:[^\"\\\n]|\\.)*\")")
_BLOBFILE = re.compile(_WS + r"BLOBFILE(?![A-Za-z0-9_])")
_DIM = re.compile(r"\s*\d+\s*")
# a scalar tensor body: NUMBER, HEXFLOAT, STRING, true, false, inf or nan, each a whole token
_BODY_SCALAR = re.compile(_WS + 
    r"(\"(?:[^\"\\\n]|\\.)*\"|[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)[pP][+-]?\d+"
    r"|[+-]?(?:inf|nan)(?![A-Za-z0-9_])|[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|(?:true|false)(?![A-Za-z0-9_]))")
# The compiler's own statements, each in one match: `(k = v, ...)` of variables only, and the
# attributes `[name = string("n")];` or `[name = string("n"), val = ` before a const's value.
_ARG = r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=\s*[A-Za-z_][A-Za-z0-9_]*\s*"
_VAR_ARGS = re.compile(rf"\s*\(((?:{_ARG},)*{_ARG})?\)")
_NAME_ATTR = re.compile(r'\s*\[\s*name\s*=\s*string\(\s*("[^"\\\n]*")\s*\)\s*(?:(\])\s*;|,\s*val\s*=)')
# A whole statement of one result, as the compiler prints nearly all of them, in one match:
# `type name = op(k = v, ...)[name = string("n")];` or the same up to a const's `val = `.
_ONE_RESULT = re.compile(
    r'\s*(tensor<[^<>]*>|[A-Za-z_][A-Za-z0-9_]*) ([A-Za-z_][A-Za-z0-9_]*) = ([A-Za-z_][A-Za-z0-9_]*)'
    r'\(((?:[A-Za-z_][A-Za-z0-9_]* = [A-Za-z_][A-Za-z0-9_]*, )*[A-Za-z_][A-Za-z0-9_]* = [A-Za-z_][A-Za-z0-9_]*)?\)'
    r'\[name = string\(("[^"\\\n]*")\)(?:(\]);|, val = )')
_STRING_TYPE = TensorType("string", None)
_PUNCT = {s: re.compile(_WS + re.escape(s)) for s in ("(", ")", "[", "]", "{", "}", "<", ">", ",", "=", ";", "->")}


class _Reader:
    def __init__(self, text: str, lit):
        self.text, self.pos, self.lit = text, 0, lit  # lit: the parser's literal helpers
        self.types: dict[str, TensorType] = {}

    # --- tokens ---------------------------------------------------------------------------
    def accept(self, s: str) -> bool:
        """Consume the punctuation `s` if it comes next."""
        m = _PUNCT[s].match(self.text, self.pos)
        if m is None:
            return False
        self.pos = m.end()
        return True

    def take(self, s: str) -> None:
        if not self.accept(s):
            raise NotFast

    def peek(self, s: str) -> bool:
        return _PUNCT[s].match(self.text, self.pos) is not None

    def match(self, pattern: re.Pattern) -> re.Match:
        m = pattern.match(self.text, self.pos)
        if m is None:
            raise NotFast
        self.pos = m.end()
        return m

    def name(self) -> str:
        return self.match(_NAME).group(1)

    def word(self, s: str) -> None:
        """A keyword: `s` not followed by a name character (lark reads `funcx` as one NAME)."""
        if self.name() != s:
            raise NotFast

    # --- types ----------------------------------------------------------------------------
    def tensor_type(self, m: re.Match) -> TensorType:
        key = m.group(1)
        t = self.types.get(key)
        if t is None:
            dtype = self.lit.known_dtype(m.group(2))
            inner = m.group(3)
            if inner.strip():
                parts = inner.split(",")
                if not all(_DIM.fullmatch(p) for p in parts):
                    raise NotFast
                shape = tuple(int(p) for p in parts)
            else:
                shape = ()
            t = self.types[key] = TensorType(dtype, shape)
        return t

    def type(self) -> TensorType:
        m = _TENSOR_TYPE.match(self.text, self.pos)
        if m is not None:
            self.pos = m.end()
            return self.tensor_type(m)
        return TensorType(self.lit.known_dtype(self.name()), None)

    def typed_name(self) -> tuple[TensorType, str]:
        t = self.type()
        return t, self.name()

    def names(self, item) -> list:
        """`item ("," item)*`, or nothing before a ")"."""
        if self.peek(")"):
            return []
        out = [item()]
        while self.accept(","):
            out.append(item())
        return out

    # --- values ---------------------------------------------------------------------------
    def value(self):
        text, pos = self.text, self.pos
        m = _NAME_OR_SCALAR.match(text, pos)  # the common case: a variable, or int32(1)
        if m is not None:
            self.pos = m.end()
            return Var(m.group(1)) if m.group(2) is None else self.lit.scalar(m.group(1), m.group(2))
        if self.accept("("):
            items = [self.value()]
            while self.accept(","):
                items.append(self.value())
            self.take(")")
            return tuple(items)
        m = _TENSOR_TYPE.match(text, pos)
        if m is not None:
            self.pos = m.end()
            return self.tensor_value(self.tensor_type(m))
        m = _SCALAR.match(text, pos)
        if m is not None:
            self.pos = m.end()
            return self.lit.scalar(m.group(1), m.group(2))
        name = self.name()
        if self.accept("("):  # spaced out: NAME ( scalar )
            body = self.match(_BODY_SCALAR).group(1)
            self.take(")")
            return self.lit.scalar(name, body)
        return Var(name)

    def tensor_value(self, t: TensorType):
        self.take("(")
        m = _LIST.match(self.text, self.pos)
        if m is not None:
            self.pos = m.end()
            value = self.lit.tensor(t, m.group(1))
        elif _BLOBFILE.match(self.text, self.pos):
            self.match(_BLOBFILE)
            self.take("(")
            value = self.lit.blob(t, self.kwargs(")"))
            self.take(")")
        else:
            value = self.lit.tensor(t, self.match(_BODY_SCALAR).group(1))
        self.take(")")
        return value

    def kwargs(self, close: str) -> dict:
        out: dict = {}
        if self.peek(close):
            return out
        while True:
            key = self.match(_KEY).group(1)
            if key in out:
                raise NotFast
            out[key] = self.value()
            if not self.accept(","):
                return out

    def var_args(self) -> dict | None:
        """`(k = v, ...)` when every value is a variable, else None (read token by token)."""
        m = _VAR_ARGS.match(self.text, self.pos)
        if m is None:
            return None
        out = _var_pairs(m.group(1))
        self.pos = m.end()
        return out

    def name_attrs(self) -> dict | None:
        """`[name = string("n")];` or `[name = string("n"), val = <value>];`, else None."""
        start = self.pos
        m = _NAME_ATTR.match(self.text, start)
        if m is None:
            return None
        self.pos = m.end()
        return self.named(m.group(1), m.group(2) is None, start)

    def named(self, quoted: str, val_follows: bool, start: int) -> dict | None:
        """The attributes of a matched `[name = string(quoted)` (the patterns admit no escapes),
        with `val = <value>` read here when `val_follows`, up to `];`; None, back at `start`,
        when more attributes follow: the token reader takes them all."""
        attrs = {"name": Literal(_STRING_TYPE, quoted[1:-1])}
        if val_follows:  # `, val = `
            attrs["val"] = self.value()
            if not self.accept("]"):
                self.pos = start
                return None
            self.take(";")
        return attrs

    # --- structure ------------------------------------------------------------------------
    def one_result(self) -> Statement | None:
        """A statement spaced as the printer spaces it, one match of `_ONE_RESULT`, else None."""
        start = self.pos
        m = _ONE_RESULT.match(self.text, start)
        if m is None:
            return None
        kind = m.group(1)
        if kind.startswith("tensor<"):
            tm = _TENSOR_TYPE.match(kind)
            if tm is None or tm.end() != len(kind):
                return None
            t = self.tensor_type(tm)
        else:
            t = TensorType(self.lit.known_dtype(kind), None)
        self.pos = m.end()
        attrs = self.named(m.group(5), m.group(6) is None, start)
        return None if attrs is None else Statement([(t, m.group(2))], m.group(3), _var_pairs(m.group(4)), attrs)

    def statement(self) -> Statement:
        one = self.one_result()
        if one is not None:
            return one
        results = [self.typed_name()]
        while self.accept(","):
            results.append(self.typed_name())
        self.take("=")
        op = self.name()
        args = self.var_args()
        if args is None:
            self.take("(")
            args = self.kwargs(")")
            self.take(")")
        attrs = self.name_attrs()
        if attrs is None:
            attrs = {}
            if self.accept("["):
                attrs = self.kwargs("]")
                self.take("]")
            self.take(";")
        return Statement(results, op, args, attrs)

    def function(self) -> Function:
        name = self.name()
        self.take("<")
        opset = self.name()
        self.take(">")
        self.take("(")
        inputs = self.names(self.typed_name)
        self.take(")")
        self.take("{")
        body = []
        while not self.accept("}"):
            body.append(self.statement())
        self.take("->")
        self.take("(")
        outputs = self.names(self.name)
        self.take(")")
        self.accept(";")
        return Function(name, opset, inputs, body, outputs)

    def program(self) -> Program:
        self.word("program")
        self.take("(")
        version = self.match(_NUMBER).group(1)
        self.take(")")
        build_info = self.build_info() if self.peek("[") else None
        self.take("{")
        functions: dict[str, Function] = {}
        while not self.accept("}"):
            self.word("func")
            fn = self.function()
            if fn.name in functions:
                raise NotFast
            functions[fn.name] = fn
        self.match(_END)
        return Program(self.lit.version(version), build_info, functions)

    def build_info(self) -> list[tuple[str, str]]:
        """`[buildInfo = dict<string, string>({{"k", "v"}, ...})]`."""
        self.take("[")
        if self.name() != "buildInfo":
            raise NotFast
        self.take("=")
        self.word("dict")
        self.take("<")
        types = [self.type()]
        self.take(",")
        types.append(self.type())
        self.take(">")
        if any(t.dtype != "string" or t.shape not in (None, ()) for t in types):
            raise NotFast
        self.take("(")
        self.take("{")
        pairs = []
        while self.accept("{"):
            k = self.lit.string(self.match(_STRING).group(1))
            self.take(",")
            pairs.append((k, self.lit.string(self.match(_STRING).group(1))))
            self.take("}")
            if not self.accept(","):
                break
            if not self.peek("{"):
                raise NotFast
        self.take("}")
        self.take(")")
        self.take("]")
        return pairs


def _var_pairs(body: str | None) -> dict:
    """`k = v, ...` (variables only) -> {k: Var(v)}; NotFast on a repeated argument."""
    pairs = [part.split("=") for part in body.split(",")] if body else []
    out = {k.strip(): Var(v.strip()) for k, v in pairs}
    if len(out) < len(pairs):
        raise NotFast  # the grammar reports it
    return out


def read_program(text: str, lit) -> Program:
    """The Program of `text`, or NotFast. `lit` converts literals: `known_dtype(name)`,
    `scalar(dtype, text)`, `tensor(type, body)`, `blob(type, kwargs)`, `version(text)` and
    `string(quoted)`, each raising NotFast where the grammar's callbacks would report an error."""
    return _Reader(text, lit).program()
