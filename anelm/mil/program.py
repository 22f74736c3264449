"""The MIL program model: what the parser produces, the printer writes and the emulator runs.

It mirrors Apple's in-memory MIL text one to one:

    program(1.3)
    [buildInfo = dict<string, string>({{"k", "v"}, ...})]
    {
        func main<ios18>(tensor<fp16, [1, 64, 1, 32]> x, ...) {
            tensor<fp16, [1, 64, 1, 32]> y = relu(x = x)[name = string("y")];
        } -> (y);
    }

A statement binds one or more typed results to an op call. Arguments inside `(...)` are
`args`; those inside `[...]` are `attrs` (always `name`, and for `const` also `val`;
`constexpr_*` ops put every operand there). An argument is a variable reference, an inline
literal, a BLOBFILE reference, or a tuple of those (concat's `values`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Union

import numpy as np

# MIL dtype spelling -> numpy dtype. `string` has no numpy dtype.
NUMPY_DTYPES = {
    "fp16": np.float16,
    "fp32": np.float32,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "uint64": np.uint64,
    "bool": np.bool_,
}
ITEMSIZE = {k: np.dtype(v).itemsize for k, v in NUMPY_DTYPES.items()}
# Sub-byte MIL dtypes (quantized weights, LUT indices). numpy has none, so values live in an
# int8 (signed) or uint8 container; BLOBFILE packs them LSB first.
SUBBYTE_BITS = {"int4": 4, "uint1": 1, "uint2": 2, "uint3": 3, "uint4": 4, "uint6": 6}


def storage_dtype(dtype: str) -> np.dtype:
    """numpy dtype that holds values of a MIL dtype (the container for sub-byte types)."""
    if dtype in SUBBYTE_BITS:
        return np.dtype(np.int8 if dtype.startswith("int") else np.uint8)
    return np.dtype(NUMPY_DTYPES[dtype])


@lru_cache(maxsize=None)  # np.iinfo costs microseconds, and the parser asks once per integer literal
def int_range(dtype: str) -> tuple[int, int]:
    """Smallest and largest value of an integer MIL dtype, sub-byte ones included."""
    if dtype in SUBBYTE_BITS:
        bits = SUBBYTE_BITS[dtype]
        return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if dtype == "int4" else (0, (1 << bits) - 1)
    info = np.iinfo(NUMPY_DTYPES[dtype])
    return int(info.min), int(info.max)


@dataclass(frozen=True)
class TensorType:
    """A MIL type. `shape is None` is a scalar (`fp16`); `()` is a rank-0 tensor (`tensor<fp16, []>`)."""

    dtype: str
    shape: tuple[int, ...] | None = None

    @property
    def is_scalar(self) -> bool:
        return self.shape is None or self.shape == ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1  # not np.prod: read per request, 10x its cost

    @property
    def nbytes(self) -> int:
        """Bytes as stored: sub-byte dtypes packed (a BLOBFILE's payload size)."""
        if self.dtype in SUBBYTE_BITS:
            return -(-self.numel * SUBBYTE_BITS[self.dtype] // 8)
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Var:
    """A reference to a function input or an earlier statement's result."""

    name: str


@dataclass(frozen=True, eq=False)
class Literal:
    """An inline value. `value` is a numpy array of `type`'s shape (0-d for scalars) or a str."""

    type: TensorType
    value: object


@dataclass(frozen=True)
class BlobRef:
    """`tensor<...>(BLOBFILE(path = string("@model_path/..."), offset = uint64(64)))`.

    `offset` locates the 64-byte metadata block in the blob file, not the data itself.
    """

    type: TensorType
    path: str
    offset: int


Arg = Union[Var, Literal, BlobRef, tuple]


@dataclass
class Statement:
    results: list[tuple[TensorType, str]]
    op: str
    args: dict[str, Arg] = field(default_factory=dict)
    attrs: dict[str, Arg] = field(default_factory=dict)

    @property
    def name(self) -> str | None:
        """The `name = string("...")` attribute, which may differ from the result variable."""
        lit = self.attrs.get("name")
        return lit.value if isinstance(lit, Literal) else None

    def operands(self) -> dict[str, Arg]:
        """Every operand, from both the call and the attribute brackets, except `name`."""
        out = dict(self.args)
        out.update((k, v) for k, v in self.attrs.items() if k != "name")
        return out


@dataclass
class Function:
    name: str
    opset: str
    inputs: list[tuple[TensorType, str]]
    body: list[Statement]
    outputs: list[str]

    def input_types(self) -> dict[str, TensorType]:
        return {n: t for t, n in self.inputs}

    def result_types(self) -> dict[str, TensorType]:
        """Type of every name bound in the function: inputs and statement results."""
        types = self.input_types()
        for st in self.body:
            types.update((n, t) for t, n in st.results)
        return types


@dataclass
class Program:
    version: str = "1.3"
    build_info: list[tuple[str, str]] | None = None
    functions: dict[str, Function] = field(default_factory=dict)

    @property
    def main(self) -> Function:
        if "main" in self.functions:
            return self.functions["main"]
        return next(iter(self.functions.values()))


# The buildInfo that Apple's in-memory compiler is given by both reference systems.
DEFAULT_BUILD_INFO = [
    ("coremlc-component-MIL", "3510.2.1"),
    ("coremlc-version", "3505.4.1"),
    ("coremltools-component-milinternal", ""),
    ("coremltools-version", "9.0"),
]
