"""The op table: one entry per MIL op, with shape/dtype inference and a float32 compute.

The compiler uses `infer` for the IR; the emulator runs `compute` on the parsed MIL text.
Tests check `compute` against independent references (float64 numpy written in the
tests, or torch), never against this table itself.

Operand kinds, by MIL argument name:
  * `inputs`: tensor operands (values flowing through the graph, or tensor consts);
  * `params`: non-tensor arguments (axis, perm, transpose flags, dtype strings, ...) that
    the codegen writes as named consts and the emulator hands to `compute` as Python values;
  * `const_inputs`: tensor operands that must be compile-time consts (conv weight).

`compute(x: dict[str, np.ndarray float32], p: dict[str, Any]) -> list[np.ndarray]` computes
in float32; the emulator rounds each result to the declared dtype (fp16 in `strict`).
`infer(t: dict[str, TensorType], p: dict[str, Any]) -> list[TensorType]` raises ShapeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..mil.program import TensorType

Infer = Callable[[dict[str, TensorType], dict[str, Any]], list[TensorType]]
Compute = Callable[[dict[str, Any], dict[str, Any]], list[Any]]


@dataclass(frozen=True)
class OpDef:
    name: str  # MIL spelling
    inputs: tuple[str, ...]  # tensor operands in MIL argument order
    params: dict[str, Any] = field(default_factory=dict)  # name -> default (REQUIRED if none)
    infer: Infer | None = None
    compute: Compute | None = None
    optional: frozenset[str] = frozenset()  # inputs that may be absent (conv bias, sdpa mask)
    const_inputs: frozenset[str] = frozenset()
    in_attrs: bool = False  # constexpr_*: every operand sits in the [...] brackets


REQUIRED = object()
OP_TABLE: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    assert op.name not in OP_TABLE, f"op {op.name} registered twice"
    OP_TABLE[op.name] = op
    return op
