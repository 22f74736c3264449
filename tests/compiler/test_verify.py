"""verify: IR invariants, each break reported with node and invariant."""

import numpy as np
import pytest

from anelm.compiler.verify import verify
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from anelm.ir.graph import Value
from anelm.mil.program import TensorType


def good():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    h = b.linear(x, np.ones((4, 4)), name="p")
    b.output("y", b.relu(h))
    return b.build()


def broken(mutate):
    g = good()
    mutate(g)
    with pytest.raises(CompileError) as e:
        verify(g, after="some_pass")
    assert "some_pass" in str(e.value)
    return e.value


def test_good_graph_verifies():
    verify(good())


def test_use_before_definition():
    err = broken(lambda g: g.nodes.reverse())
    assert "before it is defined" in err.constraint


def test_duplicate_name():
    def dup(g):
        g.nodes[-1].name = g.nodes[-1].out.name = "p"
    assert "defined twice" in broken(dup).constraint


def test_type_mismatch_with_inference():
    def retype(g):
        g.outputs["y"].type = TensorType("fp16", (1, 4, 1, 9))
    err = broken(retype)
    assert err.node == "y" and "inferred" in err.constraint


def test_operands_that_no_longer_type_check():
    def bad_operand(g):
        g.node("p").inputs["x"] = g.outputs["y"].producer.inputs["x"]  # conv reads its own result
    assert "before it is defined" in broken(bad_operand).constraint


def test_returned_value_not_defined():
    def dangling(g):
        g.outputs["z"] = Value("ghost", TensorType("fp16", (1,)))
    err = broken(dangling)
    assert err.node == "z" and "no statement" in err.constraint


def test_var_must_equal_node_name():
    def rename_node(g):
        g.outputs["y"].producer.name = "other"
    assert "differs from the node name" in broken(rename_node).constraint
