"""concat_elimination: a returned concat becomes several outputs; an inner one is an error."""

import numpy as np
import pytest

from anelm.compiler.registry import run_pass
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate


def returned_concat():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    a, c = b.relu(x, name="a"), b.exp(x, name="c")
    b.output("first", b.tanh(x, name="t"))
    b.output("y", b.concat([a, c, a * 2.0], axis=-3))
    return b.build()


def test_returned_concat_becomes_parts_with_reassembly_record():
    g = returned_concat()
    xv = np.random.default_rng(6).standard_normal((1, 4, 1, 8))
    ref = evaluate(g, [xv])
    assert g.op_list() == ["relu", "exp", "tanh", "mul", "concat"]
    assert run_pass("concat_elimination", g)
    assert g.op_list() == ["relu", "exp", "tanh", "mul"]
    assert list(g.outputs) == ["first", "y_p0", "y_p1", "y_p2"]
    rec = g.meta["concat_outputs"]["y"]
    assert rec == {"parts": ["y_p0", "y_p1", "y_p2"], "axis": 1}  # axis normalised
    got = evaluate(g, [xv])
    rebuilt = np.concatenate([got[p] for p in rec["parts"]], axis=rec["axis"])
    np.testing.assert_array_equal(rebuilt, ref["y"])
    np.testing.assert_array_equal(got["first"], ref["first"])


def test_nested_concats_flatten_first():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    inner = b.concat([b.relu(x), b.exp(x)], axis=1)
    b.output("y", b.concat([inner, b.tanh(x)], axis=1))
    g = b.build()
    assert run_pass("concat_elimination", g)
    assert g.meta["concat_outputs"]["y"]["parts"] == ["y_p0", "y_p1", "y_p2"]
    assert "concat" not in g.op_list()


def test_concat_read_inside_is_compile_error_with_fix():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    cat = b.concat([x, x], axis=1, name="cat")
    b.output("y", b.relu(cat))
    with pytest.raises(CompileError) as e:
        run_pass("concat_elimination", b.build())
    assert e.value.node == "cat" and "read inside" in e.value.constraint
    assert "concatenate on the CPU" in e.value.fix


def test_profile_allowing_concat_leaves_it():
    g = returned_concat()
    loose = STRICT.replace(rejected_ops=["gelu"])
    assert not run_pass("concat_elimination", g, loose)
    assert "concat" in g.op_list()
