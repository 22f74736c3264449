"""conv_bias_split: conv(bias=b) -> conv + add of a [1, C, 1, 1] const."""

import numpy as np

from anelm.compiler.registry import run_pass
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate

RNG = np.random.default_rng(4)


def test_bias_moves_to_add_and_names_stay():
    w, bias = RNG.standard_normal((6, 4)), RNG.standard_normal(6)
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    y = b.conv(x, w, bias=bias, name="proj")
    b.output("out", b.relu(y))
    g = b.build()
    xv = RNG.standard_normal((1, 4, 1, 8))
    ref = evaluate(g, [xv])["out"]
    assert g.op_list() == ["conv", "relu"]
    assert run_pass("conv_bias_split", g)
    assert g.op_list() == ["conv", "add", "relu"]
    conv, add = g.node("proj_conv"), g.node("proj")
    assert "bias" not in conv.inputs and add.op == "add" and add.inputs["x"] is conv.out
    bias_const = add.inputs["y"].producer
    assert bias_const.is_const and bias_const.blob and bias_const.value.shape == (1, 6, 1, 1)
    assert g.outputs["out"].producer.inputs["x"] is add.out
    np.testing.assert_allclose(evaluate(g, [xv])["out"], ref, rtol=1e-12, atol=1e-12)


def test_runtime_bias_is_reshaped():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    bv = b.input("bias", [6])
    b.output("y", b.conv(x, np.ones((6, 4)), bias=bv, name="c"))
    g = b.build()
    assert run_pass("conv_bias_split", g)
    assert g.op_list() == ["conv", "reshape", "add"]
    add = g.outputs["y"].producer
    assert add.op == "add" and add.inputs["y"].shape == (1, 6, 1, 1)
    assert add.name == "y" and add.inputs["x"].name == "y_conv"  # output() had named the conv "y"


def test_no_bias_no_change():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", b.linear(x, np.ones((6, 4))))
    assert not run_pass("conv_bias_split", b.build())
