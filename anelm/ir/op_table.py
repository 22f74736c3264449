"""The op table's machinery: one entry per MIL op, with shape/dtype inference and a float32
compute. The ops_* modules `define` their families here; `ops` is the table with all of them.

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
`bind(p, shapes) -> fn` (optional, one-result ops) is `compute` specialised once to full params
and fixed operand shapes (`shapes` in `inputs` order): `fn(*arrays)` takes the operands in that
order and returns the one result, the same values from the same numpy calls as `compute`, with
the shape and axis bookkeeping done at bind time (the emulator's small-tensor steps run so).

Param values are plain Python: int, float, bool, str, or lists of those (a MIL `tensor<int32,
[4]>` const becomes a list of 4 ints). A tuple operand (concat's `values`) arrives as a list of
TensorTypes in `infer` and a list of arrays in `compute`. Scalars have `shape None`; infer treats
them as rank 0. Entries made by `define` fill missing params with the MIL defaults themselves.
Param defaults of `None` mean "depends on the input" (layer_norm/reduce axes: all; slice masks:
all false; strides: all 1), as MIL documents them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ShapeError
from ..mil.program import TensorType

Infer = Callable[[dict[str, TensorType], dict[str, Any]], list[TensorType]]
Compute = Callable[[dict[str, Any], dict[str, Any]], list[Any]]
Bind = Callable[[dict[str, Any], tuple[tuple[int, ...], ...]], Callable[..., Any]]


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
    bind: Bind | None = None  # compute for fixed params and shapes (module doc), or None


REQUIRED = object()
OP_TABLE: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    assert op.name not in OP_TABLE, f"op {op.name} registered twice"
    OP_TABLE[op.name] = op
    return op


# The raw compute of each `define`d op skips the defaults merge: the emulator fills the params
# once at compile time and calls it per request.
_RAW_COMPUTE: dict[str, Compute] = {}


def _fill_params(op: OpDef, p: dict[str, Any]) -> dict[str, Any]:
    """Params with MIL defaults filled in; a missing required one is a ShapeError."""
    unknown = sorted(set(p) - set(op.params))
    if unknown:
        raise ShapeError(f"{op.name}: expected params among {sorted(op.params)}, got unknown {unknown}")
    out = dict(op.params)
    out.update(p)
    missing = sorted(k for k, v in out.items() if v is REQUIRED)
    if missing:
        raise ShapeError(f"{op.name}: expected param(s) {missing}, got none")
    return out


def _check_inputs(op: OpDef, t: dict[str, Any]) -> None:
    missing = [k for k in op.inputs if k not in t and k not in op.optional]
    if missing:
        raise ShapeError(f"{op.name}: expected input(s) {missing}, got only {sorted(t)}")
    unknown = sorted(set(t) - set(op.inputs))
    if unknown:
        raise ShapeError(f"{op.name}: expected inputs among {list(op.inputs)}, got unknown {unknown}")


def define(name: str, inputs: tuple[str, ...], infer: Infer, compute: Compute, *,
           params: dict[str, Any] | None = None, optional: tuple[str, ...] = (),
           const_inputs: tuple[str, ...] = (), in_attrs: bool = False, bind: Bind | None = None) -> OpDef:
    """Register an op whose `infer`/`compute` fill param defaults and prefix errors with the op.

    The raw functions may then assume every param is present and raise `ShapeError` with just
    "expected ..., got ..."; callers see "matmul: expected ..., got ...".
    """
    def _infer(t: dict[str, TensorType], p: dict[str, Any]) -> list[TensorType]:
        _check_inputs(op, t)
        full = _fill_params(op, p)
        try:
            return infer(t, full)
        except ShapeError as e:
            raise ShapeError(f"{name}: {e}") from None

    def _compute(x: dict[str, Any], p: dict[str, Any]) -> list[Any]:
        return compute(x, _fill_params(op, p))

    # the closures above read `op` when called, after it is bound here
    op = OpDef(name, tuple(inputs), dict(params or {}), _infer, _compute,
               frozenset(optional), frozenset(const_inputs), in_attrs, bind)
    _RAW_COMPUTE[name] = compute
    return register(op)


def full_params(name: str, p: dict[str, Any]) -> dict[str, Any]:
    """`p` with the MIL defaults of op `name` filled in (ShapeError on missing/unknown)."""
    return _fill_params(OP_TABLE[name], p)


def raw_compute(op: OpDef) -> Compute:
    """The compute function without the per-call defaults merge (params must be full)."""
    return _RAW_COMPUTE.get(op.name, op.compute)


def infer_node(name: str, t: dict[str, TensorType], p: dict[str, Any], node: str = "") -> list[TensorType]:
    """Infer through OP_TABLE, naming the node in the error; unknown ops are a ShapeError too."""
    op = OP_TABLE.get(name)
    where = f"node '{node}': " if node else ""
    if op is None:
        raise ShapeError(f"{where}op '{name}' is not in the op table; expected one of {sorted(OP_TABLE)}")
    try:
        return op.infer(t, p)
    except ShapeError as e:
        raise ShapeError(f"{where}{e}") from None
