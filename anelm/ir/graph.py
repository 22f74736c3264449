"""A small typed SSA graph: the compiler's IR between the builder and MIL codegen.

    Graph(name, inputs=[Value], nodes=[Node, ...] in topological order, outputs={name: Value})

Every Value is defined once: by a graph input or by one Node (`producer`). Node operands are
MIL argument names (`x`, `y`, `weight`, `values` for concat's tuple); `params` hold the
non-tensor arguments (axes, perm, transpose flags, ...) that codegen turns into named consts.
A `const` node carries its array in `value`; `blob=True` sends it to a BLOBFILE (weights,
masks), `blob=False` writes it inline (scalars, small int vectors).

Types come from `OP_TABLE[op].infer` when a node is created, so a graph is typed as it is
built. Tensors are BC1S `[1, C, 1, S]` (apple/ml-ane-transformers "Principle 1") with other
ranks only where MIL needs them (attention `[1, H, S, D]`).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..errors import ShapeError
from ..mil.program import TensorType
from .ops import OP_TABLE, REQUIRED, infer_node

BC1S = 4  # rank of the ANE's native layout [batch, channels, 1, sequence]
DTYPES = ("fp16", "fp32", "int8", "int32", "bool")
_NP_TO_MIL = {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32", np.dtype(np.int8): "int8",
              np.dtype(np.int32): "int32", np.dtype(np.bool_): "bool"}
_MIL_TO_NP = {v: k for k, v in _NP_TO_MIL.items()}


def np_dtype(dtype: str) -> np.dtype:
    """numpy dtype for a graph dtype name."""
    if dtype not in _MIL_TO_NP:
        raise ShapeError(f"dtype '{dtype}' is not a graph dtype; expected one of {DTYPES}")
    return _MIL_TO_NP[dtype]


def const_type(array: np.ndarray) -> TensorType:
    """MIL type of a const: a 0-d array is a scalar (`fp16`), otherwise a tensor."""
    dt = _NP_TO_MIL.get(np.asarray(array).dtype)
    if dt is None:
        raise ShapeError(f"const dtype {np.asarray(array).dtype} is not one of {DTYPES}")
    return TensorType(dt, None if array.ndim == 0 else tuple(int(d) for d in array.shape))


class Value:
    """An SSA value. Arithmetic operators build nodes through the builder that made it."""

    __slots__ = ("name", "type", "producer", "builder")

    def __init__(self, name: str, type: TensorType, producer: "Node | None" = None):
        self.name, self.type, self.producer = name, type, producer
        self.builder = None  # set by GraphBuilder: enables `a + b`, `x @ w`

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def rank(self) -> int:
        return len(self.type.shape) if self.type.shape else 0

    def _b(self):
        if self.builder is None:
            raise TypeError(f"value '{self.name}' has no builder; operators only work on builder values")
        return self.builder

    def __add__(self, o): return self._b().add(self, o)
    def __radd__(self, o): return self._b().add(o, self)
    def __sub__(self, o): return self._b().sub(self, o)
    def __rsub__(self, o): return self._b().sub(o, self)
    def __mul__(self, o): return self._b().mul(self, o)
    def __rmul__(self, o): return self._b().mul(o, self)
    def __truediv__(self, o): return self._b().real_div(self, o)
    def __rtruediv__(self, o): return self._b().real_div(o, self)
    def __matmul__(self, o): return self._b().matmul(self, o)
    def __pow__(self, o): return self._b().pow(self, o)
    def __neg__(self): return self._b().mul(self, -1.0)

    def __repr__(self) -> str:
        return f"%{self.name}: {_fmt_type(self.type)}"


class Node:
    """One op application. `inputs` maps MIL argument names to Values (a tuple for concat)."""

    def __init__(self, op: str, name: str, inputs: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None, outputs: list[Value] | None = None,
                 value: np.ndarray | None = None, blob: bool = False):
        self.op, self.name = op, name
        self.inputs = dict(inputs or {})
        self.params = dict(params or {})
        self.outputs = list(outputs or [])
        self.value, self.blob = value, blob

    @property
    def out(self) -> Value:
        return self.outputs[0]

    @property
    def is_const(self) -> bool:
        return self.op == "const"

    def operands(self) -> Iterator[tuple[str, Value]]:
        """(argument name, Value) for every tensor operand, tuples flattened."""
        for arg, v in self.inputs.items():
            if isinstance(v, tuple):
                yield from ((arg, item) for item in v)
            else:
                yield arg, v

    def replace_input(self, old: Value, new: Value) -> int:
        """Rewire every operand slot that reads `old`; returns how many were changed."""
        n = 0
        for arg, v in list(self.inputs.items()):
            if isinstance(v, tuple):
                if any(item is old for item in v):
                    n += sum(item is old for item in v)
                    self.inputs[arg] = tuple(new if item is old else item for item in v)
            elif v is old:
                self.inputs[arg], n = new, n + 1
        return n

    def __repr__(self) -> str:
        return f"Node({self.op} '{self.name}')"


def infer_types(op: str, inputs: dict[str, Any], params: dict[str, Any], node: str) -> list[TensorType]:
    """Result types from the op table; tuple operands are handed over as tuples of types.

    `identity` is IR-only (the ANE compiler walls it, per aneforge's op sweep): it has no table
    entry, its type is its operand's, and identity elimination removes it before codegen.
    """
    types = {k: tuple(i.type for i in v) if isinstance(v, tuple) else v.type for k, v in inputs.items()}
    if op == "identity":
        return [types["x"]]
    return list(infer_node(op, types, params, node))


def with_defaults(op: str, params: dict[str, Any]) -> dict[str, Any]:
    """Params with the op table's defaults filled in (explicit MIL, as the references emit)."""
    full = {k: v for k, v in OP_TABLE[op].params.items() if v is not REQUIRED and v is not None} \
        if op in OP_TABLE else {}
    full.update(params)
    return full


class Graph:
    """Inputs, nodes in topological order, and outputs in the intended (declared) order."""

    def __init__(self, name: str = "main"):
        self.name = name
        self.inputs: list[Value] = []
        self.nodes: list[Node] = []
        self.outputs: dict[str, Value] = {}
        self.meta: dict[str, Any] = {}  # pass records: concat_outputs, aliases, sram, warnings
        self._taken: set[str] = set()

    # --- construction --------------------------------------------------------------------
    def peek_name(self, base: str) -> str:
        """`base` if unused, else `base_1`, `base_2`, ... (deterministic); not reserved."""
        name, i = base, 0
        while name in self._taken:
            i += 1
            name = f"{base}_{i}"
        return name

    def fresh_name(self, base: str) -> str:
        """Like `peek_name`, and reserves the name."""
        name = self.peek_name(base)
        self._taken.add(name)
        return name

    def release_name(self, name: str) -> None:
        """Free a name whose definition was removed, so a rewrite can reuse it."""
        self._taken.discard(name)

    def add_input(self, name: str, type: TensorType) -> Value:
        if name in self._taken:
            raise ShapeError(f"input name '{name}' is already used in graph '{self.name}'")
        self._taken.add(name)
        v = Value(name, type)
        self.inputs.append(v)
        return v

    def add_node(self, op: str, inputs: dict[str, Any], params: dict[str, Any] | None = None,
                 name: str | None = None) -> Node:
        """Create a typed node (inferred through OP_TABLE) and append it."""
        name = self.fresh_name(name or op)
        params = with_defaults(op, params or {})
        types = infer_types(op, inputs, params, name)
        node = Node(op, name, inputs, params)
        node.outputs = [Value(name if i == 0 else self.fresh_name(f"{name}_{i}"), t, node)
                        for i, t in enumerate(types)]
        self.nodes.append(node)
        return node

    def add_const(self, array: np.ndarray, name: str | None = None, blob: bool = False) -> Value:
        array = np.asarray(array)
        node = Node("const", self.fresh_name(name or "const"), value=array, blob=blob)
        node.outputs = [Value(node.name, const_type(array), node)]
        self.nodes.append(node)
        return node.out

    def rename(self, value: Value, new: str) -> None:
        """Rename a value (and its single-output producer, so MIL var == name attribute)."""
        if new == value.name:
            return
        if new in self._taken:
            raise ShapeError(f"cannot rename '{value.name}' to '{new}': the name is taken")
        self._taken.add(new)
        value.name = new
        if value.producer is not None and len(value.producer.outputs) == 1:
            value.producer.name = new

    # --- queries -------------------------------------------------------------------------
    def uses(self, value: Value) -> list[tuple[Node, str]]:
        return [(n, arg) for n in self.nodes for arg, v in n.operands() if v is value]

    def users(self, value: Value) -> list[Node]:
        seen: list[Node] = []
        for n, _ in self.uses(value):
            if all(n is not s for s in seen):
                seen.append(n)
        return seen

    def is_output(self, value: Value) -> bool:
        return any(v is value for v in self.outputs.values())

    def is_input(self, value: Value) -> bool:
        return any(v is value for v in self.inputs)

    def op_list(self, consts: bool = False) -> list[str]:
        """Op names in order (consts left out by default): what pass tests compare."""
        return [n.op for n in self.nodes if consts or not n.is_const]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named '{name}' in graph '{self.name}'")

    # --- rewrites ------------------------------------------------------------------------
    def replace_all_uses(self, old: Value, new: Value, outputs: bool = True) -> None:
        """Point every reader of `old` (and, by default, the returned names) at `new`."""
        for n in self.nodes:
            n.replace_input(old, new)
        if outputs:
            for k, v in self.outputs.items():
                if v is old:
                    self.outputs[k] = new

    def remove_nodes(self, dead) -> None:
        ids = {id(n) for n in dead}
        self.nodes = [n for n in self.nodes if id(n) not in ids]

    def topo_sort(self) -> None:
        """Stable topological order: a node's producers are placed right before it when needed.

        Nodes appended by a rewrite therefore land next to their first reader, which keeps
        the emitted MIL in data-flow order. Raises ShapeError on a cycle or a foreign operand.
        """
        if self._in_order():
            return  # what a builder makes, and what most passes leave: the sort would keep it
        known = {id(v) for v in self.inputs}
        placed: set[int] = set()
        order: list[Node] = []
        for root in self.nodes:
            stack, onpath = [(root, False)], set()
            while stack:
                node, expanded = stack.pop()
                if id(node) in placed:
                    continue
                if expanded:
                    onpath.discard(id(node))
                    placed.add(id(node))
                    order.append(node)
                    continue
                if id(node) in onpath:
                    raise ShapeError(f"graph '{self.name}' has a cycle through node '{node.name}'")
                onpath.add(id(node))
                stack.append((node, True))
                for _, v in reversed(list(node.operands())):
                    if id(v) in known:
                        continue
                    if v.producer is None:
                        raise ShapeError(f"node '{node.name}' reads '{v.name}', which nothing defines")
                    if id(v.producer) not in placed:
                        stack.append((v.producer, False))
        self.nodes = order

    def _in_order(self) -> bool:
        """Whether every node reads only inputs and results of the nodes before it (and is
        listed once: the sort drops repeats)."""
        defined = {id(v) for v in self.inputs}
        for n in self.nodes:
            for _, v in n.operands():
                if id(v) not in defined:
                    return False
            for o in n.outputs:
                if id(o) in defined:
                    return False
                defined.add(id(o))
        return True

    def copy(self) -> "Graph":
        """Deep copy of the structure; const arrays are shared (passes never edit them in place)."""
        g = Graph(self.name)
        g.meta = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                  for k, v in self.meta.items()}
        g._taken = set(self._taken)
        vmap: dict[int, Value] = {}
        for v in self.inputs:
            vmap[id(v)] = Value(v.name, v.type)
            g.inputs.append(vmap[id(v)])
        for n in self.nodes:
            m = Node(n.op, n.name, params=dict(n.params), value=n.value, blob=n.blob)
            m.inputs = {k: tuple(vmap[id(i)] for i in v) if isinstance(v, tuple) else vmap[id(v)]
                        for k, v in n.inputs.items()}
            m.outputs = [Value(o.name, o.type, m) for o in n.outputs]
            vmap.update((id(o), mo) for o, mo in zip(n.outputs, m.outputs))
            g.nodes.append(m)
        g.outputs = {k: vmap[id(v)] for k, v in self.outputs.items()}
        return g

    def __str__(self) -> str:
        ins = ", ".join(repr(v) for v in self.inputs)
        lines = [f"graph {self.name}({ins}) {{"]
        for n in self.nodes:
            lines.append("    " + _fmt_node(n))
        outs = ", ".join(k if v.name == k else f"{k}={v.name}" for k, v in self.outputs.items())
        lines.append(f"}} -> ({outs})")
        return "\n".join(lines)


def _fmt_type(t: TensorType) -> str:
    return t.dtype if t.shape is None else f"{t.dtype}{list(t.shape)}"


def _fmt_node(n: Node) -> str:
    res = ", ".join(repr(o) for o in n.outputs)
    if n.is_const:
        kind = "blob" if n.blob else (repr(n.value.tolist()) if n.value.size <= 8 else "inline")
        return f"{res} = const({kind})"
    args = [f"{k}=" + ("(" + ", ".join(i.name for i in v) + ")" if isinstance(v, tuple) else v.name)
            for k, v in n.inputs.items()]
    args += [f"{k}={v!r}" for k, v in n.params.items()]
    return f"{res} = {n.op}({', '.join(args)})"
