"""The SSA graph: construction with inferred types, use lists, rewiring, topo sort, copy."""

import numpy as np
import pytest

from anelm.errors import ShapeError
from anelm.ir.graph import Graph, Node, Value, const_type
from anelm.mil.program import TensorType

F16 = "fp16"


def small():
    g = Graph("t")
    x = g.add_input("x", TensorType(F16, (1, 4, 1, 8)))
    two = g.add_const(np.float16(2.0), "two")
    m = g.add_node("mul", {"x": x, "y": two}, name="m").out
    r = g.add_node("relu", {"x": m}, name="r").out
    g.outputs["y"] = r
    return g, x, two, m, r


def test_add_node_infers_type_and_names_value_after_node():
    g, x, two, m, r = small()
    assert m.type == TensorType(F16, (1, 4, 1, 8))
    assert two.type == TensorType(F16, None)  # 0-d array -> MIL scalar
    assert m.producer.name == m.name == "m"
    assert g.op_list() == ["mul", "relu"]
    assert g.op_list(consts=True) == ["const", "mul", "relu"]


def test_matmul_shape_inferred_through_op_table():
    g = Graph()
    q = g.add_input("q", TensorType(F16, (1, 2, 16, 8)))
    k = g.add_input("k", TensorType(F16, (1, 2, 32, 8)))
    n = g.add_node("matmul", {"x": q, "y": k}, {"transpose_x": False, "transpose_y": True})
    assert n.out.shape == (1, 2, 16, 32)


def test_bad_operands_raise_shape_error_naming_node():
    g = Graph()
    a = g.add_input("a", TensorType(F16, (1, 4, 1, 8)))
    b = g.add_input("b", TensorType(F16, (1, 5, 1, 8)))
    with pytest.raises(ShapeError, match="node 'bad'"):
        g.add_node("add", {"x": a, "y": b}, name="bad")


def test_unknown_op_is_shape_error():
    g = Graph()
    a = g.add_input("a", TensorType(F16, (1, 4, 1, 8)))
    with pytest.raises(ShapeError, match="frobnicate"):
        g.add_node("frobnicate", {"x": a})


def test_identity_is_typed_without_op_table():
    g = Graph()
    a = g.add_input("a", TensorType("fp32", (2, 3)))
    assert g.add_node("identity", {"x": a}).out.type == a.type


def test_fresh_names_are_deterministic_and_unique():
    g, *_ = small()
    assert g.fresh_name("m") == "m_1"
    assert g.fresh_name("m") == "m_2"
    assert g.peek_name("zz") == "zz" and g.peek_name("zz") == "zz"
    with pytest.raises(ShapeError):
        g.add_input("x", TensorType(F16, (1,)))


def test_users_and_replace_all_uses_including_outputs():
    g, x, two, m, r = small()
    assert [n.name for n in g.users(x)] == ["m"]
    assert g.uses(m) == [(r.producer, "x")]
    g.replace_all_uses(r, m)
    assert g.outputs["y"] is m
    g.replace_all_uses(m, x, outputs=False)
    assert r.producer.inputs["x"] is x and g.outputs["y"] is m


def test_replace_input_in_tuple_operand():
    a, b, c = (Value(n, TensorType(F16, (1, 2, 1, 2))) for n in "abc")
    node = Node("concat", "cat", {"values": (a, b, a)}, {"axis": 1})
    assert node.replace_input(a, c) == 2
    assert node.inputs["values"] == (c, b, c)
    assert [v.name for _, v in node.operands()] == ["c", "b", "c"]


def test_topo_sort_restores_order_and_is_stable():
    g, x, two, m, r = small()
    extra = g.add_node("exp", {"x": x}, name="e").out
    g.outputs["e"] = extra
    want = [n.name for n in g.nodes]
    g.nodes = g.nodes[::-1]
    g.topo_sort()
    names = [n.name for n in g.nodes]
    assert names.index("two") < names.index("m") < names.index("r")
    g.topo_sort()
    assert [n.name for n in g.nodes] == names  # idempotent
    assert sorted(names) == sorted(want)


def test_topo_sort_of_an_ordered_graph_keeps_its_order_and_drops_repeats():
    g, x, two, m, r = small()
    order = list(g.nodes)
    g.topo_sort()  # already in order: nothing moves
    assert g.nodes == order
    g.nodes = order + [order[0]]  # a node listed twice is placed once, as the full sort does
    g.topo_sort()
    assert g.nodes == order


def test_topo_sort_detects_cycle():
    g, x, two, m, r = small()
    m.producer.inputs["x"] = r  # m reads r, r reads m
    with pytest.raises(ShapeError, match="cycle"):
        g.topo_sort()


def test_topo_sort_rejects_foreign_operand():
    g, x, two, m, r = small()
    stranger = Value("s", x.type)
    m.producer.inputs["x"] = stranger
    with pytest.raises(ShapeError, match="nothing defines"):
        g.topo_sort()


def test_copy_is_independent():
    g, x, two, m, r = small()
    g.meta["aliases"] = {"a": "b"}
    c = g.copy()
    assert [n.name for n in c.nodes] == [n.name for n in g.nodes]
    assert c.outputs["y"] is not r and c.outputs["y"].producer is c.nodes[-1]
    assert c.nodes[1].inputs["x"] is c.inputs[0]
    c.nodes.pop()
    c.meta["aliases"]["a"] = "z"
    c.rename(c.inputs[0], "x2")
    assert g.op_list() == ["mul", "relu"] and g.meta["aliases"]["a"] == "b" and x.name == "x"


def test_rename_keeps_var_equal_to_node_name():
    g, x, two, m, r = small()
    g.rename(r, "y")
    assert r.name == r.producer.name == "y"
    with pytest.raises(ShapeError, match="taken"):
        g.rename(m, "x")


def test_const_type_rejects_float64_and_types_vectors():
    assert const_type(np.array([1, 2], np.int32)) == TensorType("int32", (2,))
    with pytest.raises(ShapeError):
        const_type(np.zeros(3))


def test_str_shows_ops_and_outputs():
    g, *_ = small()
    text = str(g)
    assert "mul(x=x, y=two)" in text and "-> (y=r)" in text
