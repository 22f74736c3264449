"""decompose: conservative forms (docs/architecture.md), numerics against float64 references."""

import math

import numpy as np
import pytest

from anelm.compiler.registry import run_pass
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from graph_ref_interp import evaluate
from helpers import rel_err

RNG = np.random.default_rng(5)
X = RNG.standard_normal((1, 8, 1, 16))


def one_op(build, shape=(1, 8, 1, 16)):
    b = GraphBuilder()
    x = b.input("x", list(shape))
    b.output("y", build(b, x))
    return b.build()


def decomposed(g, profile=STRICT):
    before = g.op_list()
    assert run_pass("decompose", g, profile)
    return before, g.op_list()


def test_gelu_becomes_tanh_form():
    g = one_op(lambda b, x: b.gelu(x, mode="EXACT"))
    before, after = decomposed(g)
    assert before == ["gelu"] and "gelu" not in after and "tanh" in after
    assert set(after) == {"mul", "add", "tanh"}
    exact = 0.5 * X * (1 + np.vectorize(math.erf)(X / math.sqrt(2)))
    assert rel_err(evaluate(g, [X])["y"], exact) < 2e-3  # the tanh form approximates erf


def test_gelu_sigmoid_mode():
    g = one_op(lambda b, x: b.gelu(x, mode="SIGMOID_APPROXIMATION"))
    assert decomposed(g)[1] == ["mul", "sigmoid", "mul"]
    assert rel_err(evaluate(g, [X])["y"], X / (1 + np.exp(-1.702 * X))) < 2e-3


def test_silu_is_x_times_sigmoid():
    g = one_op(lambda b, x: b.silu(x))
    assert decomposed(g) == (["silu"], ["sigmoid", "mul"])
    assert g.outputs["y"].producer.inputs["x"] is g.inputs[0]
    assert rel_err(evaluate(g, [X])["y"], X / (1 + np.exp(-X))) < 1e-12


def test_reduce_mean_is_sum_times_reciprocal():
    g = one_op(lambda b, x: b.reduce_mean(x, axes=[1, 3], keep_dims=False))
    assert decomposed(g) == (["reduce_mean"], ["reduce_sum", "mul"])
    assert g.outputs["y"].shape == (1, 1)
    assert rel_err(evaluate(g, [X])["y"], X.mean(axis=(1, 3))) < 1e-3  # 1/128 is exact in fp16


def test_rsqrt_is_pow_minus_half():
    g = one_op(lambda b, x: b.rsqrt(x))
    assert decomposed(g) == (["rsqrt"], ["pow"])
    xv = np.abs(X) + 0.1
    assert rel_err(evaluate(g, [xv])["y"], 1 / np.sqrt(xv)) < 1e-12


def test_rsqrt_keeps_a_representable_epsilon():
    g = one_op(lambda b, x: b.rsqrt(x, epsilon=1e-3))
    assert decomposed(g)[1] == ["add", "pow"]
    xv = np.abs(X) + 0.1
    assert rel_err(evaluate(g, [xv])["y"], 1 / np.sqrt(xv + 1e-3)) < 1e-3


def test_sqrt_only_when_profile_rejects_it():
    g = one_op(lambda b, x: b.sqrt(x))
    assert not run_pass("decompose", g)
    assert decomposed(g, STRICT.replace(reject_rsqrt=True)) == (["sqrt"], ["pow"])
    xv = np.abs(X)
    assert rel_err(evaluate(g, [xv])["y"], np.sqrt(xv)) < 1e-12


def test_layer_norm_written_out():
    gv, bv = RNG.standard_normal(8), RNG.standard_normal(8)
    g = one_op(lambda b, x: b.layer_norm(x, axes=[1], gamma=gv, beta=bv, epsilon=1e-5))
    before, after = decomposed(g)
    assert before == ["layer_norm"] and "reduce_mean" not in after and after.count("reduce_sum") == 2
    mu = X.mean(axis=1, keepdims=True)
    ref = (X - mu) / np.sqrt(((X - mu) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    ref = ref * gv.reshape(1, 8, 1, 1) + bv.reshape(1, 8, 1, 1)
    assert rel_err(evaluate(g, [X])["y"], ref) < 2e-3


def sdpa_graph(mask):
    b = GraphBuilder()
    q, k, v = (b.input(n, [1, 2, 16, 8]) for n in "qkv")
    b.output("o", b.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return b.build()


def attention_ref(q, k, v, mask):
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]) + mask
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("kind", ["none", "additive", "bool"])
def test_sdpa_always_decomposed(kind):
    causal = np.tril(np.ones((16, 16), bool))
    mask = {"none": None, "additive": np.where(causal, 0.0, -1e4)[None, None], "bool": causal[None, None]}[kind]
    g = sdpa_graph(mask)
    before, after = decomposed(g)
    assert before == ["scaled_dot_product_attention"]
    want = ["matmul", "mul"] + (["add"] if mask is not None else []) + ["softmax", "matmul"]
    assert after == want
    qk = g.node("o_qk")
    assert qk.params == {"transpose_x": False, "transpose_y": True}
    q, k, v = (RNG.standard_normal((1, 2, 16, 8)) for _ in range(3))
    additive = 0.0 if mask is None else np.where(causal, 0.0, -1e4)
    assert rel_err(evaluate(g, [q, k, v])["o"], attention_ref(q, k, v, additive)) < 1e-3


def test_runtime_bool_mask_is_compile_error():
    b = GraphBuilder()
    q = b.input("q", [1, 2, 16, 8])
    m = b.input("m", [1, 1, 16, 16], "bool")
    b.output("o", b.scaled_dot_product_attention(q, q, q, attn_mask=m, name="att"))
    with pytest.raises(CompileError) as e:
        run_pass("decompose", b.build())
    assert e.value.node == "o" and "additive" in e.value.fix  # output() named the node "o"


def test_nothing_to_do():
    g = one_op(lambda b, x: b.relu(x))
    assert not run_pass("decompose", g)
