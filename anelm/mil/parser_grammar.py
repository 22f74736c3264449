"""The MIL grammar (mil.lark) run by lark: the reference reader, and the one that reports.

`parser.parse` reads text with the hand-written reader of `parser_fast` first; what that
declines comes here, to the LALR(1) grammar with the tree transformer embedded in the parser
(no parse tree is built; its tokens are coarse, as lark's cost is per token). Every error is a
`MILSyntaxError` with the line and column it points at and what was expected there.
"""

from __future__ import annotations

import threading
from pathlib import Path

from lark import Lark, Token, Transformer, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..errors import MILSyntaxError
from .literals import (_SCALAR_PARTS, _STRING, _VERSION, _Fail, _blob_ref, _dtype, _fail_at, _scalar_literal,
                     _tensor_literal, _tensor_type, _unquote)
from .program import Function, Program, Statement, TensorType, Var

_TERMINAL_NAMES = {  # how an expected token is named in error messages
    "NAME": "a name", "KEY": "an argument such as x =", "TENSOR_TYPE": "a tensor type",
    "SCALAR": "a literal such as int32(1)", "NUMBER": "a number", "HEXFLOAT": "a hex float",
    "STRING": "a string", "LIST": "a bracketed list", "FLOATWORD": "inf or nan",
    "$END": "end of input", "<END-OF-FILE>": "end of input",
}


class _Build(Transformer):
    """Builds the Program while LALR reduces; each method is one grammar rule."""

    def start(self, c):
        version, rest = c[0], c[1:]
        if not _VERSION.fullmatch(str(version)):
            raise _fail_at(version, f"expected a program version such as 1.3 or 1.0, found '{version}'")
        build_info = rest.pop(0)[1] if rest and rest[0][0] == "build_info" else None
        functions = {}
        for fn, tok in rest:
            if fn.name in functions:
                raise _fail_at(tok, f"function '{fn.name}' is defined twice; expected unique function names")
            functions[fn.name] = fn
        return Program(str(version), build_info, functions)

    def build_info(self, c):
        if c[0] != "buildInfo":
            raise _fail_at(c[0], f"expected program attribute buildInfo, found '{c[0]}'")
        for ttype, tok in c[1:3]:
            if ttype.dtype != "string" or ttype.shape not in (None, ()):
                raise _fail_at(tok, "expected buildInfo as dict<string, string>")
        return ("build_info", list(c[3:]))

    def pair(self, c):
        return (_unquote(c[0]), _unquote(c[1]))

    def function(self, c):
        name, opset, rest = c[0], c[1], c[2:]
        inputs = rest.pop(0)[1] if rest and isinstance(rest[0], tuple) and rest[0][0] == "params" else []
        outputs = rest.pop()[1] if rest and isinstance(rest[-1], tuple) and rest[-1][0] == "names" else []
        return Function(str(name), str(opset), inputs, list(rest), outputs), name

    def params(self, c):
        return ("params", [(t, n) for t, n, _ in c])

    def names(self, c):
        return ("names", [str(n) for n in c])

    def typed_name(self, c):
        return (c[0][0], str(c[1]), c[1])

    def statement(self, c):
        results = [(t, n) for t, n, _ in (x for x in c if isinstance(x, tuple) and len(x) == 3)]
        op = next(x for x in c if isinstance(x, Token))
        tagged = {x[0]: x[1] for x in c if isinstance(x, tuple) and len(x) == 2}
        return Statement(results, str(op), tagged.get("kwargs", {}), tagged.get("attrs", {}))

    def attrs(self, c):
        return ("attrs", c[0][1] if c else {})

    def kwargs(self, c):
        out = {}
        for tok, value in c:
            name = tok[:-1].rstrip()  # a KEY token is the name with its `=`
            if name in out:
                raise _fail_at(tok, f"argument '{name}' is given twice; expected each argument once")
            out[name] = value
        return ("kwargs", out)

    def kwarg(self, c):
        return (c[0], c[1])

    def var(self, c):
        return Var(str(c[0]))

    def tuple(self, c):
        return tuple(c)

    def scalar_lit(self, c):
        if len(c) == 2:  # spaced out: NAME "(" scalar ")"
            return _scalar_literal(_dtype(str(c[0]), c[0]), c[1], str(c[1]), 0)
        m = _SCALAR_PARTS.match(c[0])  # one SCALAR token: int32(1)
        return _scalar_literal(_dtype(m.group(1), c[0]), c[0], m.group(2), m.start(2))

    def tensor_lit(self, c):
        ttype, body = _tensor_type(c[0]), c[1]
        if isinstance(body, tuple):  # ("blob", kwargs, BLOBFILE token)
            return _blob_ref(ttype, body[2], body[1])
        return _tensor_literal(ttype, body)

    def blobfile(self, c):
        return ("blob", c[1][1], c[0])

    def scalar_type(self, c):
        return (TensorType(_dtype(str(c[0]), c[0]), None), c[0])

    def tensor_type(self, c):
        return (_tensor_type(c[0]), c[0])


_lock = threading.Lock()
_lark: Lark | None = None


def _parser() -> Lark:
    global _lark
    with _lock:
        if _lark is None:
            grammar = (Path(__file__).parent / "mil.lark").read_text()
            _lark = Lark(grammar, parser="lalr", lexer="contextual", transformer=_Build(), maybe_placeholders=False)
        return _lark


def _describe(terminals, lark: Lark) -> str:
    shown = set()
    for name in terminals:
        if name in _TERMINAL_NAMES:
            shown.add(_TERMINAL_NAMES[name])
            continue
        try:
            pattern = lark.get_terminal(name).pattern
        except KeyError:
            shown.add(name)
            continue
        shown.add(f"'{pattern.value}'" if pattern.type == "str" else name)
    return ", ".join(sorted(shown)) or "nothing"


def _syntax_error(e: UnexpectedInput, text: str, source: str) -> MILSyntaxError:
    lark = _parser()
    line, column = getattr(e, "line", -1), getattr(e, "column", -1)
    at_end = False
    if isinstance(e, UnexpectedCharacters):
        char = text[e.pos_in_stream]
        if char == '"' and not _STRING.match(text, e.pos_in_stream):  # STRING stops at a line end
            return MILSyntaxError("unterminated string; expected a closing '\"' on the same line", line, column, source)
        found, expected = repr(char), e.allowed
    elif isinstance(e, (UnexpectedToken, UnexpectedEOF)):
        tok = getattr(e, "token", None)
        at_end = tok is None or tok.type == "$END"
        if not at_end and tok == "<" and text[: tok.start_pos].rstrip().endswith("tensor"):
            return MILSyntaxError("malformed tensor type; expected tensor<dtype, [d0, d1, ...]>", line, column, source)
        found, expected = ("end of input" if at_end else repr(str(tok))), e.expected
    else:  # pragma: no cover - lark has no other kinds today
        found, expected = "input", ()
    if at_end or line is None or line < 1:  # lark places end of input at the last token
        line, column = text.count("\n") + 1, len(text) - text.rfind("\n")
    return MILSyntaxError(f"unexpected {found}; expected {_describe(expected, lark)}", line, column, source)


def parse_with_grammar(text: str, source: str = "model.mil") -> Program:
    """`parse` by the lark grammar alone (the reference the fast path is checked against)."""
    lark = _parser()
    try:
        return lark.parse(text)
    except _Fail as e:
        raise MILSyntaxError(e.message, e.line, e.column, source) from None
    except UnexpectedInput as e:
        raise _syntax_error(e, text, source) from None
