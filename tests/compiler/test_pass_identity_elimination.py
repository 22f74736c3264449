"""identity_elimination: identity, same-dtype cast, same-shape reshape, identity transpose."""

import numpy as np

from anelm.compiler.registry import run_pass
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate


def test_all_four_identities_go_and_numbers_stay():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    t = b.identity(x)
    t = b.cast(t, "fp16")
    t = b.reshape(t, [1, 4, 1, 8])
    t = b.transpose(t, [0, 1, 2, 3])
    b.output("y", b.tanh(t))
    g = b.build()
    xv = np.random.default_rng(1).standard_normal((1, 4, 1, 8)).astype(np.float16)  # exact through the cast
    ref = evaluate(g, [xv])["y"]
    assert g.op_list() == ["identity", "cast", "reshape", "transpose", "tanh"]
    assert run_pass("identity_elimination", g)
    assert g.op_list() == ["tanh"]
    assert g.outputs["y"].producer.inputs["x"] is x
    np.testing.assert_array_equal(evaluate(g, [xv])["y"], ref)


def test_real_reshape_transpose_and_cast_stay():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    t = b.transpose(b.reshape(x, [1, 1, 4, 8]), [0, 1, 3, 2])
    b.output("y", b.cast(t, "fp32"))
    g = b.build()
    assert not run_pass("identity_elimination", g)
    assert g.op_list() == ["reshape", "transpose", "cast"]


def test_returned_identity_of_an_input_is_kept():
    # forwarding would make the program return its own input, which MIL cannot bind
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", b.identity(x))
    b.output("z", b.relu(x))
    g = b.build()
    assert not run_pass("identity_elimination", g)
    assert g.op_list() == ["identity", "relu"]


def test_returned_identity_of_internal_value_forwards_output():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    r = b.relu(x)
    b.output("y", b.reshape(r, [1, 4, 1, 8]))
    g = b.build()
    assert run_pass("identity_elimination", g)
    assert g.outputs["y"] is r and g.op_list() == ["relu"]
