"""Decomposition into the conservative forms every chip takes (one pass, a table of rules).

    gelu                          -> 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    silu                          -> x · sigmoid(x)
    reduce_mean                   -> reduce_sum × 1/N
    rsqrt                         -> pow(x, -0.5)
    sqrt                          -> pow(x, 0.5), only when the profile rejects sqrt
    layer_norm                    -> reduce_sum × 1/N, centre, pow(var + eps, -0.5), scale, shift
    scaled_dot_product_attention  -> matmul(q, k, transpose_y) × 1/√d (+ mask) -> softmax(-1) -> matmul(·, v)

The hardware ignores SDPA's attn_mask, so attention is always written out.
Each rewrite keeps the replaced node's name on its final value, so readers and returned
names are untouched; the steps are named `<node>_<suffix>`.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...chip.profile import STRICT, ChipProfile
from ...errors import CompileError
from ...ir.builder import GraphBuilder
from ...ir.graph import Graph, Node, Value
from ..registry import register_pass

MASK_NEG = -1e4  # additive "minus infinity" that stays finite in fp16 (ml-ane-transformers)

Rule = Callable[[GraphBuilder, Node, str], Value]


def _gelu(b: GraphBuilder, n: Node, p: str) -> Value:
    x = n.inputs["x"]
    if n.params.get("mode") == "SIGMOID_APPROXIMATION":
        return b.mul(x, b.sigmoid(b.mul(x, 1.702, name=f"{p}_sx"), name=f"{p}_sig"), name=p)
    # EXACT is approximated by the tanh form too: erf has no ANE-safe decomposition, and the
    # tanh form's error (< 1e-3 relative) is below fp16's own resolution at the result scale
    return b.gelu_tanh(x, name=p)


def _silu(b: GraphBuilder, n: Node, p: str) -> Value:
    x = n.inputs["x"]
    return b.mul(x, b.sigmoid(x, name=f"{p}_sig"), name=p)


def _reduced_count(x: Value, axes) -> int:
    axes = range(x.rank) if axes is None else [a % x.rank for a in axes]
    return int(np.prod([x.shape[a] for a in axes]))


def _reduce_mean(b: GraphBuilder, n: Node, p: str) -> Value:
    x, axes = n.inputs["x"], n.params.get("axes")
    axes = list(range(x.rank)) if axes is None else list(axes)
    s = b.reduce_sum(x, axes=axes, keep_dims=n.params.get("keep_dims", False), name=f"{p}_sum")
    return b.mul(s, b.scalar(1.0 / _reduced_count(x, axes), x.dtype, f"{p}_inv"), name=p)


def _rsqrt(b: GraphBuilder, n: Node, p: str) -> Value:
    x = n.inputs["x"]
    eps = float(n.params.get("epsilon", 0.0))
    if np.asarray(eps, dtype=np.float16 if x.dtype == "fp16" else np.float32) != 0:
        x = b.add(x, b.scalar(eps, x.dtype, f"{p}_eps"), name=f"{p}_xe")
    # pow(-0.5), not rsqrt: rsqrt after a reduce fails on some chips (rustane)
    return b.pow(x, b.scalar(-0.5, x.dtype, f"{p}_nhalf"), name=p)


def _sqrt(b: GraphBuilder, n: Node, p: str) -> Value:
    x = n.inputs["x"]
    return b.pow(x, b.scalar(0.5, x.dtype, f"{p}_half"), name=p)


def _affine_param(b: GraphBuilder, v: Value | None, x: Value, axes: list[int], name: str) -> Value | None:
    """gamma/beta have shape x.shape[axes]; give them x's rank so they broadcast."""
    if v is None:
        return None
    shape = [x.shape[a] if a in axes else 1 for a in range(x.rank)]
    if v.producer is not None and v.producer.is_const:
        return b.const(v.producer.value.reshape(shape), name=name, blob=True)
    return b.reshape(v, shape, name=name)


def _layer_norm(b: GraphBuilder, n: Node, p: str) -> Value:
    x = n.inputs["x"]
    axes = n.params.get("axes")
    axes = list(range(x.rank)) if axes is None else sorted(a % x.rank for a in axes)
    gamma = _affine_param(b, n.inputs.get("gamma"), x, axes, f"{p}_g")
    beta = _affine_param(b, n.inputs.get("beta"), x, axes, f"{p}_b")
    return b.layer_norm_decomposed(x, gamma, beta, n.params.get("epsilon", 1e-5), axes=axes, name=p)


def _additive_mask(b: GraphBuilder, n: Node, mask: Value, dtype: str, p: str) -> Value:
    if mask.dtype != "bool":
        return mask
    if mask.producer is None or not mask.producer.is_const:
        raise CompileError(n.name, "a runtime bool attn_mask has no ANE form (select is not available)",
                           "pass an additive float mask (0 to keep, -1e4 to drop) or a const bool mask")
    return b.const(np.where(mask.producer.value, 0.0, MASK_NEG), name=f"{p}_mask", dtype=dtype, blob=True)


def _sdpa(b: GraphBuilder, n: Node, p: str) -> Value:
    q, k, v = n.inputs["query"], n.inputs["key"], n.inputs["value"]
    scores = b.matmul(q, k, transpose_y=True, name=f"{p}_qk")  # [.., L, S]
    scaled = b.mul(scores, b.scalar(1.0 / math.sqrt(q.shape[-1]), q.dtype, f"{p}_scale"), name=f"{p}_scs")
    if n.inputs.get("attn_mask") is not None:
        scaled = b.add(scaled, _additive_mask(b, n, n.inputs["attn_mask"], q.dtype, p), name=f"{p}_msk")
    probs = b.softmax(scaled, axis=-1, name=f"{p}_sm")
    return b.matmul(probs, v, name=p)  # [.., L, Dv]


RULES: dict[str, Rule] = {
    "gelu": _gelu,
    "silu": _silu,
    "reduce_mean": _reduce_mean,
    "rsqrt": _rsqrt,
    "sqrt": _sqrt,
    "layer_norm": _layer_norm,
    "scaled_dot_product_attention": _sdpa,
}


def _wanted(op: str, profile: ChipProfile) -> bool:
    if op == "sqrt":  # sqrt is kept unless the chip rejects it
        return profile.reject_rsqrt or "sqrt" in profile.rejected_ops
    return op in RULES


def _rewrite(graph: Graph, n: Node, rule: Rule) -> None:
    """Replace `n` by the rule's subgraph; the final value takes `n`'s name."""
    old = n.out
    graph.remove_nodes([n])
    graph.release_name(old.name)
    new = rule(GraphBuilder.on(graph), n, old.name)
    assert new.name == old.name, f"decomposing '{old.name}' named its result '{new.name}'"
    graph.replace_all_uses(old, new)


@register_pass("decompose")
def decompose(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Rewrite ops into the forms every chip takes, e.g. silu:

        tensor<fp16, [1, 8, 1, 16]> y = silu(x = x)[name = string("y")];
     => tensor<fp16, [1, 8, 1, 16]> y_sig = sigmoid(x = x)[name = string("y_sig")];
        tensor<fp16, [1, 8, 1, 16]> y = mul(x = x, y = y_sig)[name = string("y")];
    """
    todo = [n for n in graph.nodes if _wanted(n.op, profile)]
    for n in todo:
        _rewrite(graph, n, RULES[n.op])
    if not todo:
        return None
    graph.topo_sort()  # new nodes were appended; place them before their readers
    return graph
