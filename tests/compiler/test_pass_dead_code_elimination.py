"""dead_code_elimination: drops what no output needs, keeps inputs and returned values."""

import numpy as np

from anelm.compiler.registry import run_pass
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate


def test_unused_branch_and_its_consts_go():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    unused_in = b.input("unused", [1, 4, 1, 8])
    dead = b.exp(x * 3.0)
    b.output("y", b.relu(x))
    g = b.build()
    before = g.op_list()
    xv = np.random.default_rng(0).standard_normal((1, 4, 1, 8))
    ref = evaluate(g, [xv, xv])
    assert run_pass("dead_code_elimination", g)
    assert before == ["mul", "exp", "relu"] and g.op_list() == ["relu"]
    assert g.op_list(consts=True) == ["relu"]  # the scalar 3.0 died with its reader
    assert [v.name for v in g.inputs] == ["x", "unused"]  # the signature keeps every input
    assert dead.producer not in g.nodes
    np.testing.assert_array_equal(evaluate(g, [xv, xv])["y"], ref["y"])


def test_no_change_returns_false():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", b.relu(x))
    g = b.build()
    assert not run_pass("dead_code_elimination", g)
