"""`Program` -> MIL text, exactly as Apple's in-memory compiler takes it.

The style is the canonical one of the conformance programs (and of coremltools 9 output):

    program(1.3)
    [buildInfo = dict<string, string>({{"k", "v"}})]
    {
        func main<ios18>(tensor<fp16, [1, 64, 1, 32]> x) {
            fp16 s = const()[name = string("s"), val = fp16(0.125)];
            tensor<fp16, [1, 64, 1, 32]> y = mul(x = x, y = s)[name = string("y")];
        } -> (y);
    }

Floats print as the shortest decimal that reads back to the same fp16/fp32 value, so
`parse(print_program(p))` reproduces every literal bit for bit (NaN payloads aside).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from .program import BlobRef, Function, Literal, Program, Statement, TensorType, Var, storage_dtype

_INDENT = "    "
_EXACT_INT = 2**24  # integers below this print exactly in both fp16 and fp32
_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"})


def quote(s: str) -> str:
    return '"' + s.translate(_ESCAPES) + '"'


def format_type(t: TensorType) -> str:
    if t.shape is None:
        return t.dtype
    return f"tensor<{t.dtype}, [{', '.join(str(d) for d in t.shape)}]>"


def format_float(v: np.floating) -> str:
    """Shortest text that parses back to exactly `v` in its own precision (fp16 or fp32)."""
    f = float(v)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f.is_integer() and abs(f) < _EXACT_INT:
        return ("-" if math.copysign(1.0, f) < 0 else "") + f"{abs(int(f))}.0"  # keeps -0.0
    if 1e-4 <= abs(f) < 1e16:
        return np.format_float_positional(v, unique=True, trim="0")
    return np.format_float_scientific(v, unique=True, trim="-")


def _format_element(dtype: str, x) -> str:
    if dtype == "string":
        return quote(str(x))
    if dtype == "bool":
        return "true" if x else "false"
    if dtype in ("fp16", "fp32"):
        return format_float(x)
    return str(int(x))


def format_literal(lit: Literal) -> str:
    t = lit.type
    if t.shape is None and isinstance(lit.value, str) and t.dtype == "string":  # every op's name
        return f"string({quote(lit.value)})"
    if t.dtype == "string":
        values = [lit.value] if isinstance(lit.value, str) else list(np.asarray(lit.value, dtype=object).reshape(-1))
    else:
        values = np.asarray(lit.value, dtype=storage_dtype(t.dtype)).reshape(-1)
    if len(values) != t.numel:
        raise ShapeError(f"literal of type {format_type(t)} holds {len(values)} values; expected {t.numel}")
    items = [_format_element(t.dtype, x) for x in values]
    if t.shape is None:
        return f"{t.dtype}({items[0]})"
    body = items[0] if t.shape == () else f"[{', '.join(items)}]"
    return f"{format_type(t)}({body})"


def format_value(v) -> str:
    if isinstance(v, Var):
        return v.name
    if isinstance(v, Literal):
        return format_literal(v)
    if isinstance(v, BlobRef):
        blob = f"BLOBFILE(path = string({quote(v.path)}), offset = uint64({int(v.offset)}))"
        return f"{format_type(v.type)}({blob})"
    if isinstance(v, tuple):
        return f"({', '.join(format_value(x) for x in v)})"
    raise TypeError(f"cannot print {type(v).__name__} as a MIL argument; expected Var, Literal, BlobRef or tuple")


def _kwargs(d: dict) -> str:
    return ", ".join(f"{k} = {format_value(v)}" for k, v in d.items())


def format_statement(st: Statement) -> str:
    results = ", ".join(f"{format_type(t)} {n}" for t, n in st.results)
    attrs = f"[{_kwargs(st.attrs)}]" if st.attrs else ""
    return f"{results} = {st.op}({_kwargs(st.args)}){attrs};"


def format_function(fn: Function) -> list[str]:
    params = ", ".join(f"{format_type(t)} {n}" for t, n in fn.inputs)
    lines = [f"{_INDENT}func {fn.name}<{fn.opset}>({params}) {{"]
    lines += [_INDENT * 2 + format_statement(st) for st in fn.body]
    lines.append(f"{_INDENT}}} -> ({', '.join(fn.outputs)});")
    return lines


def print_program(prog: Program) -> str:
    """The MIL text of `prog`, newline-terminated."""
    lines = [f"program({prog.version})"]
    if prog.build_info is not None:
        pairs = ", ".join(f"{{{quote(k)}, {quote(v)}}}" for k, v in prog.build_info)
        lines.append(f"[buildInfo = dict<string, string>({{{pairs}}})]")
    lines.append("{")
    for fn in prog.functions.values():
        lines += format_function(fn)
    lines.append("}")
    return "\n".join(lines) + "\n"
