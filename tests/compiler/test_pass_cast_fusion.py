"""cast_fusion: round trips vanish, chains become one cast."""

import numpy as np

from anelm.compiler.registry import run_pass
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate


def test_round_trip_vanishes():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    back = b.cast(b.cast(x, "fp32"), "fp16")
    b.output("y", b.relu(back))
    g = b.build()
    xv = np.random.default_rng(3).standard_normal((1, 4, 1, 8)).astype(np.float16)
    ref = evaluate(g, [xv])["y"]
    assert g.op_list() == ["cast", "cast", "relu"]
    assert run_pass("cast_fusion", g)
    run_pass("dead_code_elimination", g)
    assert g.op_list() == ["relu"]
    np.testing.assert_array_equal(evaluate(g, [xv])["y"], ref)


def test_chain_becomes_single_cast():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8], "fp32")
    y = b.cast(b.cast(b.cast(x, "fp16", name="c1"), "fp32", name="c2"), "fp16", name="c3")
    b.output("y", y)
    g = b.build()
    while run_pass("cast_fusion", g):
        pass
    run_pass("dead_code_elimination", g)
    assert g.op_list() == ["cast"]
    assert g.outputs["y"].producer.inputs["x"] is x and g.outputs["y"].dtype == "fp16"


def test_returned_round_trip_of_input_is_kept():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", b.cast(b.cast(x, "fp32"), "fp16"))
    g = b.build()
    assert not run_pass("cast_fusion", g)
    assert g.op_list() == ["cast", "cast"]
