"""Compile-time rejects: what the ANE compiler refuses, per the chip profile
(docs/chip-profiles.md).

Each check raises `CompileError(node, constraint, fix)` naming the op and the node. The strict
list: rejected ops (concat, gelu), conv with a bias, conv whose weight is not a const or a
constexpr_* result, matmul transpose flags written inline, a returned name no statement defines,
ops missing from the op table, and cast away from the function boundary. Peer switches add
reduce_mean/rsqrt rejects, single-chunk blob files, and the spatial-width multiple. The rules
and their messages are the table in `chip/rejects.py`, which the compiler's validation raises too.
"""

from __future__ import annotations

from ...chip.profile import ChipProfile
from ...chip.rejects import reject, rejected_sqrt, rule_on
from ...ir.ops import OP_TABLE
from ...mil.program import BlobRef, Function, Literal, Statement, Var
from .plan import node_name


def check_function(func: Function, profile: ChipProfile, weights: dict[str, bytes]) -> None:
    """Raise the first reject `func` hits under `profile`; returns quietly otherwise."""
    producers: dict[str, Statement] = {}
    for st in func.body:
        _check_statement(st, profile, producers)
        producers.update((n, st) for _, n in st.results)
    for name in func.outputs:
        if name not in producers:
            raise reject("returned_name", name, profile)
    if rule_on("cast_only_at_boundary", profile):
        _check_casts(func, profile)
    if rule_on("spatial_multiple_of", profile):
        _check_spatial(func, profile)
    if rule_on("single_chunk_blobs_only", profile):
        _check_single_chunk(func, weights, profile)


def _check_statement(st: Statement, profile: ChipProfile, producers: dict) -> None:
    node, ops = node_name(st), st.operands()
    if st.op not in OP_TABLE:
        raise reject("op_table", node, profile, op=st.op)
    if st.op in profile.rejected_ops:
        raise reject("rejected_ops", node, profile, op=st.op)
    if st.op == "conv":
        _check_conv(node, ops, profile, producers)
    if st.op == "matmul" and rule_on("reject_inline_matmul_transpose", profile):
        for flag in ("transpose_x", "transpose_y"):
            if isinstance(ops.get(flag), Literal):
                raise reject("reject_inline_matmul_transpose", node, profile, flag=flag)
    if st.op == "reduce_mean" and rule_on("reject_reduce_mean", profile):
        raise reject("reject_reduce_mean", node, profile)
    if rule_on("reject_rsqrt", profile) and rejected_sqrt(st.op, _producer_op(ops, producers)):
        raise reject("reject_rsqrt", node, profile, op=st.op)


def _check_conv(node: str, ops: dict, profile: ChipProfile, producers: dict) -> None:
    if rule_on("reject_conv_bias", profile) and "bias" in ops:
        raise reject("reject_conv_bias", node, profile)
    w = ops.get("weight")
    if rule_on("reject_dynamic_conv_weight", profile) and isinstance(w, Var):
        src = producers.get(w.name)
        if src is None or not (src.op == "const" or src.op.startswith("constexpr_")):
            what = "a function input" if src is None else f"the result of {src.op}"
            raise reject("reject_dynamic_conv_weight", node, profile, weight=w.name, what=what)


def _producer_op(ops: dict, producers: dict) -> str | None:
    x = ops.get("x")
    return producers[x.name].op if isinstance(x, Var) and x.name in producers else None


def _check_casts(func: Function, profile: ChipProfile) -> None:
    inputs, outputs = set(func.input_types()), set(func.outputs)
    for st in func.body:
        if st.op != "cast":
            continue
        x = st.operands().get("x")
        on_input = isinstance(x, Var) and x.name in inputs
        if not on_input and not any(n in outputs for _, n in st.results):
            raise reject("cast_only_at_boundary", node_name(st), profile)


def _check_spatial(func: Function, profile: ChipProfile) -> None:
    types, multiple = func.result_types(), profile.spatial_multiple_of
    for name in [n for _, n in func.inputs] + list(func.outputs):
        shape = types[name].shape or ()
        if shape and shape[-1] % multiple:
            raise reject("spatial_multiple_of", name, profile, width=shape[-1], multiple=multiple)


def _check_single_chunk(func: Function, weights: dict[str, bytes], profile: ChipProfile) -> None:
    from ...mil.blob import blob_chunks  # noqa: PLC0415 - sibling module

    seen = set()
    for st in func.body:
        for arg in st.operands().values():
            if isinstance(arg, BlobRef) and arg.path not in seen and arg.path in weights:
                seen.add(arg.path)
                n = len(blob_chunks(weights[arg.path], source=arg.path))
                if n > 1:
                    raise reject("single_chunk_blobs_only", node_name(st), profile, path=arg.path, chunks=n)
