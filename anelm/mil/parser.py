"""MIL text -> `Program`, for both dialects of MIL the project reads (grammar in mil.lark).

Parsing is a pure syntax step: literals become numpy arrays of their declared dtype and
shape (`literals`), but undefined names and unknown ops are left for the emulator and the
compiler to reject. Every error is a `MILSyntaxError` with the line and column it points at.

Text is read first by the hand-written reader of `parser_fast` (ten times faster than lark);
whatever it does not take, the grammar reads, and reports (`parser_grammar`, loaded on first use).
"""

from __future__ import annotations

from .literals import FAST
from .parser_fast import NotFast, read_program
from .program import Program


def parse(text: str, source: str = "model.mil") -> Program:
    """Parse MIL text into a Program; raise MILSyntaxError with line and column on bad input."""
    try:
        return read_program(text, FAST)
    except NotFast:
        pass
    from .parser_grammar import parse_with_grammar  # noqa: PLC0415 - lark loads in 0.5 s: on use

    return parse_with_grammar(text, source)
