"""ane_validate: the profile's constraint catalogue, each failure naming node, constraint, fix."""

import numpy as np
import pytest

from anelm.compiler.registry import run_pass
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from helpers import rms_norm_graph


def graph_with(build, shape=(1, 8, 1, 16), dtype="fp16"):
    b = GraphBuilder()
    x = b.input("x", list(shape), dtype)
    b.output("y", build(b, x))
    return b.build()


def rejected(g, profile=STRICT):
    with pytest.raises(CompileError) as e:
        run_pass("ane_validate", g, profile)
    assert e.value.fix, "every rejection says how to fix it"
    return e.value


def test_clean_graph_passes_unchanged():
    g = graph_with(lambda b, x: rms_norm_graph(b, b.linear(x, np.ones((8, 8)), name="p"), np.ones(8)))
    ops = g.op_list()
    assert not run_pass("ane_validate", g)
    assert g.op_list() == ops


@pytest.mark.parametrize("op", ["gelu", "concat"])
def test_rejected_ops(op):
    build = {"gelu": lambda b, x: b.gelu(x, name="g1"),
             "concat": lambda b, x: b.relu(b.concat([x, x], axis=1, name="g1"))}[op]
    err = rejected(graph_with(build))
    assert err.node == "g1" or err.node == "y"
    assert f"'{op}'" in err.constraint and "rejected" in err.constraint


def test_conv_bias_and_dynamic_weight():
    err = rejected(graph_with(lambda b, x: b.conv(x, np.ones((4, 8)), bias=np.zeros(4), name="c")))
    assert "bias" in err.constraint and "conv_bias_split" in err.fix
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])
    w = b.input("w", [4, 8, 1, 1])
    b.output("y", b.conv(x, w, name="dyn"))
    err = rejected(b.build())
    assert err.node == "y" and "const" in err.constraint and "matmul" in err.fix


def test_constexpr_weight_is_accepted():
    g = graph_with(lambda b, x: b.conv(x, b.constexpr_affine_dequantize(np.ones((4, 8, 1, 1), np.int8), 0.1)))
    assert not run_pass("ane_validate", g)


def test_identity_and_unknown_ops():
    err = rejected(graph_with(lambda b, x: b.identity(x)))
    assert "identity" in err.constraint
    g = graph_with(lambda b, x: b.relu(x))
    g.outputs["y"].producer.op = "frobnicate"
    assert "op table" in rejected(g).constraint


def test_inner_cast_rejected():
    err = rejected(graph_with(lambda b, x: b.exp(b.cast(b.relu(x), "fp32", name="mid"))))
    assert err.node == "mid"


def test_rank_and_dimension_limits():
    assert "rank 5" in rejected(graph_with(lambda b, x: b.relu(x), shape=(1, 2, 3, 4, 5))).constraint
    err = rejected(graph_with(lambda b, x: b.relu(x), shape=(1, 8, 1, 16385)))
    assert "16384" in err.constraint and err.node == "x"
    # channels may go to 65536, and const dims too (a 32000-row classifier weight)
    assert not run_pass("ane_validate", graph_with(lambda b, x: b.relu(x), shape=(1, 65536, 1, 16)))
    assert "65536" in rejected(graph_with(lambda b, x: b.relu(x), shape=(1, 65537, 1, 16))).constraint


def test_sdpa_mask_would_be_ignored():
    b = GraphBuilder()
    q = b.input("q", [1, 2, 16, 8])
    b.output("o", b.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros((1, 1, 16, 16))))
    assert "ignores" in rejected(b.build()).constraint


def test_profile_switches():
    two_inputs = GraphBuilder()
    x = two_inputs.input("x", [1, 8, 1, 16])
    z = two_inputs.input("z", [1, 8, 1, 16])
    two_inputs.output("y", x + z)
    assert not run_pass("ane_validate", two_inputs.graph)
    assert "one input" in rejected(two_inputs.graph, STRICT.replace(single_input_only=True)).constraint
    mean = graph_with(lambda b, x: b.reduce_mean(x))
    assert not run_pass("ane_validate", mean)
    assert "reduce_mean" in rejected(mean, STRICT.replace(reject_reduce_mean=True)).constraint
    odd = graph_with(lambda b, x: b.relu(x), shape=(1, 8, 1, 20))
    assert "multiple of 16" in rejected(odd, STRICT.replace(spatial_multiple_of=16)).constraint


def test_small_internal_tensors_are_fine():
    # a [1, 1, 1, S] reduction is far below 49,152 bytes; that is the runtime's padding concern
    g = graph_with(lambda b, x: x * b.reduce_sum(x))
    assert not run_pass("ane_validate", g)
