"""Cleanup passes: dead code, identities, constant folding, cast fusion and cast placement.

They run to a fixed point in the pipeline (Orion repeats identity -> cast -> DCE the same way).
Returned names are kept stable: a value that is returned is never replaced by a graph input
or by another returned value, since a MIL function cannot return one variable twice.
"""

from __future__ import annotations

import numpy as np

from ...chip.profile import STRICT, ChipProfile
from ...chip.rejects import reject, rule_on
from ...ir.builder import INLINE_MAX
from ...ir.graph import Graph, Node, Value, const_type, np_dtype
from ...ir.ops import OP_TABLE
from ..registry import register_pass


@register_pass("dead_code_elimination")
def dead_code_elimination(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Drop nodes that no returned value depends on. Graph inputs stay (the signature lists them).

        fp16 two = const()[...];  tensor<...> unused = mul(x = x, y = two)[...];  -> (y)
     => (both statements gone)                                                     -> (y)
    """
    live: set[int] = {id(v) for v in graph.outputs.values()}
    keep: list[Node] = []
    for n in reversed(graph.nodes):
        if any(id(o) in live for o in n.outputs):
            keep.append(n)
            live.update(id(v) for _, v in n.operands())
    if len(keep) == len(graph.nodes):
        return None
    graph.nodes = keep[::-1]
    return graph


def _forwardable(graph: Graph, old: Value, new: Value) -> bool:
    """May readers of `old` read `new` instead? Not when that would return an input or a name twice."""
    if not graph.is_output(old):
        return True
    return not graph.is_input(new) and not graph.is_output(new)


def _is_identity(n: Node) -> bool:
    x = n.inputs.get("x")
    if n.op == "identity":
        return True
    if n.op == "cast":
        return n.params["dtype"] == x.dtype
    if n.op == "reshape":
        return n.out.shape == x.shape
    if n.op == "transpose":
        return list(n.params["perm"]) == list(range(x.rank))
    return False


@register_pass("identity_elimination")
def identity_elimination(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Remove identity ops, same-dtype casts, same-shape reshapes and identity transposes.

        tensor<int32, [4]> t_perm = const()[..., val = tensor<int32, [4]>([0, 1, 2, 3])];
        tensor<fp16, [1, 8, 1, 16]> t = transpose(perm = t_perm, x = x)[name = string("t")];
        tensor<fp16, [1, 8, 1, 16]> y = relu(x = t)[name = string("y")];
     => tensor<fp16, [1, 8, 1, 16]> y = relu(x = x)[name = string("y")];
    """
    dead = []
    for n in graph.nodes:
        if not n.is_const and _is_identity(n) and _forwardable(graph, n.out, n.inputs["x"]):
            graph.replace_all_uses(n.out, n.inputs["x"])
            dead.append(n)
    if not dead:
        return None
    graph.remove_nodes(dead)
    return graph


_NO_FOLD = {"quantize", "dequantize", "identity"}  # keep the user's (de)quantization explicit


def _foldable(graph: Graph, n: Node) -> bool:
    if n.is_const or n.op in _NO_FOLD or n.op not in OP_TABLE or OP_TABLE[n.op].in_attrs:
        return False
    if len(n.outputs) != 1 or graph.is_output(n.out):  # a returned value stays computed
        return False
    return all(v.producer is not None and v.producer.is_const for _, v in n.operands())


def _const_array(v: Value) -> np.ndarray:
    a = v.producer.value
    return a.astype(np.float32) if a.dtype.kind == "f" else a


def _fold(graph: Graph, n: Node) -> None:
    """Replace `n` by a const node of the same name that holds its computed value."""
    args = {k: ([_const_array(i) for i in v] if isinstance(v, tuple) else _const_array(v))
            for k, v in n.inputs.items()}
    res = np.asarray(OP_TABLE[n.op].compute(args, dict(n.params))[0])
    t = n.out.type
    res = res.astype(np_dtype(t.dtype)).reshape(() if t.shape is None else t.shape)
    assert const_type(res) == t, f"folding '{n.name}' gave {const_type(res)}, expected {t}"
    n.op, n.inputs, n.params, n.value = "const", {}, {}, res
    n.blob = res.size > INLINE_MAX and res.dtype.kind == "f"


@register_pass("constant_folding")
def constant_folding(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Evaluate ops whose operands are all consts (OP_TABLE compute; folding is not an oracle).

        fp16 a = const()[..., val = fp16(2.0)];  fp16 b = const()[..., val = fp16(3.0)];
        fp16 ab = mul(x = a, y = b)[name = string("ab")];
     => fp16 ab = const()[name = string("ab"), val = fp16(6.0)];
    """
    changed = False
    for n in graph.nodes:  # topological order, so chains fold in one sweep
        if _foldable(graph, n):
            _fold(graph, n)
            changed = True
    return graph if changed else None


@register_pass("cast_fusion")
def cast_fusion(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Collapse cast chains: a round trip disappears, a chain becomes one cast.

        tensor<fp32, [...]> a = cast(dtype = a_dtype, x = x)[...];   // x is fp16
        tensor<fp16, [...]> b = cast(dtype = b_dtype, x = a)[...];
        tensor<fp16, [...]> y = relu(x = b)[...];
     => tensor<fp16, [...]> y = relu(x = x)[...];
    """
    changed = False
    for n in graph.nodes:
        if n.op != "cast" or n.inputs["x"].producer is None or n.inputs["x"].producer.op != "cast":
            continue
        if not graph.uses(n.out) and not graph.is_output(n.out):
            continue  # already bypassed; DCE removes it
        src = n.inputs["x"].producer.inputs["x"]
        if n.params["dtype"] == src.dtype:
            if _forwardable(graph, n.out, src):
                graph.replace_all_uses(n.out, src)
                changed = True
        else:
            n.inputs["x"] = src  # cast(cast(x, A), B) -> cast(x, B); DCE drops the inner cast
            changed = True
    return graph if changed else None


@register_pass("cast_placement")
def cast_placement(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Check (no rewrite): under `cast_only_at_boundary` a cast reads an input or is returned.

    The chip computes in fp16 throughout (docs/chip-profiles.md); surfaces may be fp32, so
    casts belong only at the function's edges.
    """
    if not rule_on("cast_only_at_boundary", profile):
        return None
    for n in graph.nodes:
        if n.op == "cast" and not graph.is_input(n.inputs["x"]) and not graph.is_output(n.out):
            raise reject("cast_only_at_boundary", n.name, profile)
    return None
