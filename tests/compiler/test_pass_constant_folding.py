"""constant_folding: ops over consts only become one const of the same name."""

import numpy as np

from anelm.compiler.registry import run_pass
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate


def test_scalar_chain_folds_to_one_const():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    a = b.scalar(2.0, name="a")
    c = b.mul(b.add(a, 1.0, name="ap1"), 0.5, name="k")  # (2 + 1) * 0.5 = 1.5
    b.output("y", x * c)
    g = b.build()
    xv = np.random.default_rng(2).standard_normal((1, 4, 1, 8))
    ref = evaluate(g, [xv])["y"]
    assert g.op_list() == ["add", "mul", "mul"]
    assert run_pass("constant_folding", g)
    assert g.op_list() == ["mul"]
    k = g.node("k")
    assert k.is_const and k.value.dtype == np.float16 and float(k.value) == 1.5 and not k.blob
    run_pass("dead_code_elimination", g)
    assert g.op_list(consts=True) == ["const", "mul"]
    np.testing.assert_allclose(evaluate(g, [xv])["y"], ref, rtol=1e-12)


def test_weight_transpose_folds_into_blob_const():
    w = np.arange(32, dtype=np.float32).reshape(1, 1, 4, 8)
    b = GraphBuilder()
    x = b.input("x", [1, 1, 8, 4])
    wt = b.transpose(b.weight("w", w), [0, 1, 3, 2], name="wt")
    b.output("y", x + wt)
    g = b.build()
    assert run_pass("constant_folding", g)
    node = g.node("wt")
    assert node.is_const and node.blob and node.value.shape == (1, 1, 8, 4)
    np.testing.assert_array_equal(node.value, w.transpose(0, 1, 3, 2).astype(np.float16))


def test_returned_and_dequantize_and_input_dependent_ops_stay():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    q = b.const(np.ones((1, 4, 1, 8), np.int8), blob=True)
    dq = b.dequantize(q, 0.5)
    b.output("c", b.add(b.scalar(1.0), 2.0))  # returned: stays computed
    b.output("y", x * dq)
    g = b.build()
    assert not run_pass("constant_folding", g)
    assert g.op_list() == ["dequantize", "add", "mul"]
