"""IR invariants, checked between passes when `ANELM_DEBUG` is set (tinygrad's `type_verify`).

`verify(graph)` raises CompileError naming the node and the broken invariant: SSA form (every
operand defined before use, one producer per value), types equal to what OP_TABLE infers,
unique names, MIL variable == name attribute, and every returned name defined.
"""

from __future__ import annotations

from ..errors import AnelmError, CompileError
from ..ir.graph import Graph, Node, const_type, infer_types

_FIX = "this is a compiler bug in the pass named above; report it with ANELM_DEBUG=2 output"


def verify(graph: Graph, after: str = "") -> None:
    where = f" (after pass '{after}')" if after else ""
    defined: set[int] = set()
    names: set[str] = set()
    for v in graph.inputs:
        _unique(v.name, names, v.name, where)
        if v.producer is not None:
            raise CompileError(v.name, f"graph input has a producer{where}", _FIX)
        defined.add(id(v))
    for n in graph.nodes:
        for arg, v in n.operands():
            if id(v) not in defined:
                raise CompileError(n.name, f"operand '{arg}' reads '{v.name}' before it is defined{where}", _FIX)
        for o in n.outputs:
            _unique(o.name, names, n.name, where)
            if o.producer is not n:
                raise CompileError(n.name, f"result '{o.name}' names another producer{where}", _FIX)
            defined.add(id(o))
        if len(n.outputs) == 1 and n.out.name != n.name:
            raise CompileError(n.name, f"result variable '{n.out.name}' differs from the node name{where}", _FIX)
        _check_types(n, where)
    for key, v in graph.outputs.items():
        if id(v) not in defined:
            raise CompileError(key, f"returned value '{v.name}' is defined by no statement{where}", _FIX)


def _unique(name: str, names: set[str], node: str, where: str) -> None:
    if name in names:
        raise CompileError(node, f"name '{name}' is defined twice{where}", _FIX)
    names.add(name)


def _check_types(n: Node, where: str) -> None:
    if n.is_const:
        want = [const_type(n.value)]
    else:
        try:
            want = infer_types(n.op, n.inputs, n.params, n.name)
        except AnelmError as e:
            raise CompileError(n.name, f"operands no longer type-check{where}: {e}", _FIX) from None
    got = [o.type for o in n.outputs]
    if want != got:
        raise CompileError(n.name, f"result types {got} differ from the inferred {want}{where}", _FIX)
