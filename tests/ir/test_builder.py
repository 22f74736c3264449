"""GraphBuilder: naming, operand coercion, linear-as-conv, composites checked against float64."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from anelm.errors import ShapeError
from anelm.ir.builder import GraphBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiler"))
from graph_ref_interp import evaluate  # noqa: E402
from helpers import rel_err, rms_norm_graph  # noqa: E402

RNG = np.random.default_rng(0)


def test_default_names_are_op_names_with_suffixes():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    a, c = b.relu(x), b.relu(x)
    assert (a.name, c.name) == ("relu", "relu_1")
    assert b.exp(a, name="e").name == "e"


def test_operators_build_nodes_and_scalars_take_tensor_dtype():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8], "fp32")
    y = (2.0 * x - 1.0) / x
    g = b.build()
    assert g.op_list() == ["mul", "sub", "real_div"]
    consts = [n for n in g.nodes if n.is_const]
    assert all(n.value.dtype == np.float32 and n.value.ndim == 0 and not n.blob for n in consts)
    assert [n.name for n in consts] == ["mul_x", "sub_y"]  # operand consts are <node>_<arg>
    assert y.shape == (1, 4, 1, 8)


def test_matmul_operator_and_neg_and_pow():
    b = GraphBuilder()
    q = b.input("q", [1, 2, 8, 4])
    k = b.input("k", [1, 2, 4, 8])
    s = -(q @ k) ** 2.0
    assert s.shape == (1, 2, 8, 8)
    assert b.build().op_list() == ["matmul", "pow", "mul"]


def test_linear_is_1x1_conv_with_reshaped_weight_and_separate_bias_add():
    w, bias = RNG.standard_normal((6, 4)), RNG.standard_normal(6)
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 5])
    y = b.linear(x, w, bias, name="proj")
    b.output("y", y)
    g = b.build()
    assert g.op_list() == ["conv", "add"]
    conv = g.node("proj_conv")
    assert conv.inputs["weight"].shape == (6, 4, 1, 1) and "bias" not in conv.inputs
    assert conv.params == {"strides": [1, 1], "pad_type": "valid", "pad": [0, 0, 0, 0],
                           "dilations": [1, 1], "groups": 1}
    assert g.node("proj_bias").value.shape == (1, 6, 1, 1) and g.node("proj_bias").blob
    xv = RNG.standard_normal((1, 4, 1, 5))
    ref = np.einsum("oi,bis->bos", w, xv[:, :, 0, :])[:, :, None, :] + bias.reshape(1, 6, 1, 1)
    assert rel_err(evaluate(g, [xv])["y"], ref) < 2e-3  # fp16 weights


def test_linear_without_bias_is_named_like_the_layer():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 5])
    assert b.linear(x, np.ones((3, 4)), name="q").name == "q"
    assert b.graph.node("q_weight").blob


def test_const_inline_vs_blob():
    b = GraphBuilder()
    small = b.const(np.arange(4))
    big = b.const(np.zeros((4, 8)))
    w = b.weight("w", np.ones(2))
    assert small.dtype == "int32" and not small.producer.blob
    assert big.dtype == "fp16" and big.producer.blob
    assert w.producer.blob and w.dtype == "fp16"


def test_rms_norm_matches_float64_reference():
    c, s = 16, 8
    xv, wv = RNG.standard_normal((1, c, 1, s)), RNG.standard_normal(c)
    b = GraphBuilder()
    x = b.input("x", [1, c, 1, s])
    b.output("y", rms_norm_graph(b, x, wv, eps=1e-5, name="rms1"))
    g = b.build()
    assert g.op_list() == ["mul", "reduce_sum", "mul", "add", "pow", "mul", "mul"]
    assert {n.name for n in g.nodes} >= {"rms1_sq", "rms1_ss", "rms1_invd", "rms1_rrms", "rms1_w"}
    ref = xv / np.sqrt((xv ** 2).mean(axis=1, keepdims=True) + 1e-5) * wv.reshape(1, c, 1, 1)
    assert rel_err(evaluate(g, [xv])["y"], ref) < 2e-3


def test_layer_norm_decomposed_matches_float64_reference():
    c, s = 12, 6
    xv = RNG.standard_normal((1, c, 1, s)) * 3 + 1
    gv, bv = RNG.standard_normal(c), RNG.standard_normal(c)
    b = GraphBuilder()
    x = b.input("x", [1, c, 1, s])
    b.output("y", b.layer_norm_decomposed(x, gv, bv, eps=1e-5, name="ln1"))
    g = b.build()
    assert "reduce_mean" not in g.op_list() and g.op_list().count("reduce_sum") == 2
    mu = xv.mean(axis=1, keepdims=True)
    var = ((xv - mu) ** 2).mean(axis=1, keepdims=True)
    ref = (xv - mu) / np.sqrt(var + 1e-5) * gv.reshape(1, c, 1, 1) + bv.reshape(1, c, 1, 1)
    assert rel_err(evaluate(g, [xv])["y"], ref) < 2e-3


def test_gelu_tanh_uses_exact_constant():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", b.gelu_tanh(x))
    g = b.build()
    assert set(g.op_list()) == {"mul", "add", "tanh"}
    xv = np.linspace(-4, 4, 32).reshape(1, 4, 1, 8)
    ref = 0.5 * xv * (1 + np.tanh(math.sqrt(2 / math.pi) * (xv + 0.044715 * xv ** 3)))
    assert rel_err(evaluate(g, [xv])["y"], ref) < 2e-3


def test_output_renames_value_when_free():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    r = b.relu(x)
    b.output("act", r)
    assert r.name == "act" and r.producer.name == "act"
    b.output("x_again", x)  # an input keeps its name
    assert x.name == "x"
    with pytest.raises(ShapeError, match="twice"):
        b.output("act", r)


def test_ops_cover_movement_reduce_and_quant():
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])
    t = b.transpose(b.reshape(x, [1, 2, 4, 16]), [0, 1, 3, 2])
    assert t.shape == (1, 2, 16, 4)
    assert b.slice_by_size(x, [0, 0, 0, 4], [1, 8, 1, 8]).shape == (1, 8, 1, 8)
    assert b.slice_by_index(x, [0, 2, 0, 0], [1, 6, 1, 16]).shape == (1, 4, 1, 16)
    assert b.concat([x, x], axis=1).shape == (1, 16, 1, 16)
    assert b.reduce_max(x).shape == (1, 1, 1, 16)
    assert b.reduce_mean(x, axes=[3], keep_dims=False).shape == (1, 8, 1)
    assert b.softmax(x, axis=1).shape == x.shape
    assert b.clip(x, -1, 1).dtype == "fp16"
    assert b.cast(x, "fp32").dtype == "fp32"
    q = b.quantize(x, 0.5, zero_point=0)
    assert q.dtype == "int8"
    assert b.dequantize(q, 0.5).dtype == "fp16"
    w = b.constexpr_affine_dequantize(np.ones((4, 8, 1, 1), np.int8), 0.25, 0, axis=0)
    assert w.shape == (4, 8, 1, 1) and w.dtype == "fp16"
    assert b.graph.node(f"{w.name}_quantized_data").blob
    assert b.conv(x, w).shape == (1, 4, 1, 16)
    assert b.layer_norm(x, axes=[1], gamma=np.ones(8), beta=np.zeros(8)).shape == x.shape
    qa = b.input("qa", [1, 2, 16, 4])
    assert b.scaled_dot_product_attention(qa, qa, qa).shape == (1, 2, 16, 4)
    assert b.maximum(x, 0.0).shape == b.minimum(x, 1.0).shape == x.shape
    assert b.rsqrt(b.sqrt(b.exp(x))).dtype == "fp16"


def test_build_is_deterministic():
    def make():
        b = GraphBuilder("d")
        x = b.input("x", [1, 8, 1, 4])
        b.output("y", b.silu(b.linear(x, np.ones((8, 8)), name="w1")) * 2.0)
        return str(b.build())
    assert make() == make()


def test_an_fp16_weight_is_shared_read_only_and_compiles_as_its_float32_values():
    from anelm.compiler.pipeline import compile_graph

    w32 = (RNG.standard_normal((48, 32)) * 0.1).astype(np.float16).astype(np.float32)
    w16 = w32.astype(np.float16)

    def artifact(w):
        b = GraphBuilder("lin")
        b.output("y", b.linear(b.input("x", [1, 32, 1, 16]), w))
        return b, compile_graph(b.build())
    b16, a16 = artifact(w16)
    shared = [n.value for n in b16.graph.nodes if n.op == "const" and np.shares_memory(n.value, w16)]
    assert shared and not any(v.flags.writeable for v in shared)  # no copy, and no pass may write it
    _, a32 = artifact(w32)
    assert a16.key() == a32.key()  # the same program and blobs: the kernel cache cannot tell them apart
    assert w16.flags.writeable and np.array_equal(w16, w32)  # the caller's array is left as it was
