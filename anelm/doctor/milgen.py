"""MIL text for the conformance probes, written directly (not through the compiler).

The device layer takes MIL text and blobs, so the probes do too: each probe is a literal
program in the dialect our compiler emits (`program(1.3)`, `func main<ios18>`, scalars as
`fp16(0.5)`, parameters as named consts), which both reference systems feed to the chip.
"""

from __future__ import annotations

import numpy as np

from ..mil.program import DEFAULT_BUILD_INFO

HEADER = ("program(1.3)\n[buildInfo = dict<string, string>({"
          + ", ".join(f'{{"{k}", "{v}"}}' for k, v in DEFAULT_BUILD_INFO) + "})]\n{\n")


def ttype(dtype: str, shape) -> str:
    """`tensor<fp16, [1, 64, 1, 384]>`"""
    return f"tensor<{dtype}, [{', '.join(str(int(d)) for d in shape)}]>"


def program(inputs: list[tuple[str, str, tuple]], body: list[str], outputs: list[str]) -> str:
    """A whole program: `inputs` as (name, dtype, shape) in declared order, raw body statements."""
    params = ", ".join(f"{ttype(dt, sh)} {n}" for n, dt, sh in inputs)
    lines = "".join(f"        {st}\n" for st in body)
    return f"{HEADER}    func main<ios18>({params}) {{\n{lines}    }} -> ({', '.join(outputs)});\n}}\n"


def _element(dtype: str, v) -> str:
    if dtype == "bool":
        return "true" if v else "false"
    if dtype.startswith("fp"):
        # repr of the float64 of an fp16 value is exact, so the parser rounds back to it
        return repr(float(np.float16(v) if dtype == "fp16" else np.float32(v)))
    return str(int(v))


def literal(dtype: str, value) -> str:
    """A scalar `fp16(0.5)`, `string("valid")`, or a tensor `tensor<int32, [4]>([0, 0, 0, 64])`."""
    if dtype == "string":
        return f'string("{value}")'
    arr = np.asarray(value)
    if arr.ndim == 0 and not isinstance(value, (list, tuple)):
        return f"{dtype}({_element(dtype, arr.item())})"
    body = ", ".join(_element(dtype, v) for v in arr.reshape(-1).tolist())
    return f"{ttype(dtype, arr.shape)}([{body}])"


def const(name: str, dtype: str, value) -> str:
    """A named const statement; tensors are typed by the value's shape."""
    text = literal(dtype, value)
    typ = text[: text.index(">(") + 1] if text.startswith("tensor") else dtype
    return f'{typ} {name} = const()[name = string("{name}"), val = {text}];'


def blob_const(name: str, dtype: str, shape, path: str, offset: int = 64) -> str:
    """A const read from a BLOBFILE; `offset` locates the tensor's 64-byte metadata block."""
    t = ttype(dtype, shape)
    return (f'{t} {name} = const()[name = string("{name}"), val = {t}(BLOBFILE('
            f'path = string("{path}"), offset = uint64({offset})))];')


def op(result: str, dtype: str, shape, opname: str, /, **args: str) -> str:
    """`<type> result = opname(k = v, ...)[name = string("result")];` with raw argument text."""
    call = ", ".join(f"{k} = {v}" for k, v in args.items())
    return f'{ttype(dtype, shape)} {result} = {opname}({call})[name = string("{result}")];'
