"""Compile-time rejects: what the ANE compiler refuses, per the chip profile (CONTRACTS §2).

Each check raises `CompileError(node, constraint, fix)` naming the op and the node. The strict
list: rejected ops (concat, gelu), conv with a bias, conv whose weight is not a const or a
constexpr_* result, matmul transpose flags written inline, a returned name no statement defines,
ops missing from the op table, and cast away from the function boundary. Peer switches add
reduce_mean/rsqrt rejects, single-chunk blob files, and the spatial-width multiple.
"""

from __future__ import annotations

from ..chip.profile import ChipProfile
from ..errors import CompileError
from ..ir.ops import OP_TABLE
from ..mil.program import BlobRef, Function, Literal, Statement, Var
from .emulator_plan import node_name


def check_function(func: Function, profile: ChipProfile, weights: dict[str, bytes]) -> None:
    """Raise the first reject `func` hits under `profile`; returns quietly otherwise."""
    producers: dict[str, Statement] = {}
    for st in func.body:
        _check_statement(st, profile, producers)
        producers.update((n, st) for _, n in st.results)
    for name in func.outputs:
        if name not in producers:
            raise CompileError(name, "returned name is defined by no statement",
                               "return a variable that a statement binds (not an input)")
    if profile.cast_only_at_boundary:
        _check_casts(func)
    if profile.spatial_multiple_of > 1:
        _check_spatial(func, profile.spatial_multiple_of)
    if profile.single_chunk_blobs_only:
        _check_single_chunk(func, weights)


def _check_statement(st: Statement, profile: ChipProfile, producers: dict) -> None:
    node, ops = node_name(st), st.operands()
    if st.op not in OP_TABLE:
        raise CompileError(node, f"op '{st.op}' is not in the emulator's op table",
                           "use an op the ANE compiler supports")
    if st.op in profile.rejected_ops:
        raise CompileError(node, f"op '{st.op}' is rejected by the ANE compiler (profile '{profile.name}')",
                           _REJECT_FIX.get(st.op, "decompose it into supported ops"))
    if st.op == "conv":
        _check_conv(node, ops, profile, producers)
    if st.op == "matmul" and profile.reject_inline_matmul_transpose:
        for flag in ("transpose_x", "transpose_y"):
            if isinstance(ops.get(flag), Literal):
                raise CompileError(node, f"matmul has an inline {flag} literal",
                                   f"bind {flag} to a named bool const")
    if st.op == "reduce_mean" and profile.reject_reduce_mean:
        raise CompileError(node, f"op 'reduce_mean' is rejected (profile '{profile.name}')",
                           "use reduce_sum then mul by 1/N")
    if profile.reject_rsqrt and (st.op == "rsqrt" or (st.op == "sqrt" and _after_reduce(ops, producers))):
        raise CompileError(node, f"op '{st.op}' is rejected after a reduce (profile '{profile.name}')",
                           "use pow(x, -0.5)")


_REJECT_FIX = {
    "concat": "return the parts as separate outputs or pack them on the CPU",
    "gelu": "write it out, e.g. the tanh approximation from mul/add/tanh",
}


def _check_conv(node: str, ops: dict, profile: ChipProfile, producers: dict) -> None:
    if profile.reject_conv_bias and "bias" in ops:
        raise CompileError(node, "conv has a bias argument", "drop bias= and add a [1, C, 1, 1] const after the conv")
    w = ops.get("weight")
    if profile.reject_dynamic_conv_weight and isinstance(w, Var):
        src = producers.get(w.name)
        if src is None or not (src.op == "const" or src.op.startswith("constexpr_")):
            what = "a function input" if src is None else f"the result of {src.op}"
            raise CompileError(node, f"conv weight '{w.name}' is {what}, not a const or constexpr_* result",
                               "use matmul for runtime weights (the dynamic-weight pattern)")


def _after_reduce(ops: dict, producers: dict) -> bool:
    x = ops.get("x")
    return isinstance(x, Var) and x.name in producers and producers[x.name].op.startswith("reduce_")


def _check_casts(func: Function) -> None:
    inputs, outputs = set(func.input_types()), set(func.outputs)
    for st in func.body:
        if st.op != "cast":
            continue
        x = st.operands().get("x")
        on_input = isinstance(x, Var) and x.name in inputs
        if not on_input and not any(n in outputs for _, n in st.results):
            raise CompileError(node_name(st), "cast is allowed only directly on a function input or on a returned value",
                               "compute in fp16 and cast only at the boundary")


def _check_spatial(func: Function, multiple: int) -> None:
    types = func.result_types()
    for name in [n for _, n in func.inputs] + list(func.outputs):
        shape = types[name].shape or ()
        if shape and shape[-1] % multiple:
            raise CompileError(name, f"I/O tensor's last dim {shape[-1]} is not a multiple of {multiple}",
                               f"pad the spatial axis to a multiple of {multiple}")


def _check_single_chunk(func: Function, weights: dict[str, bytes]) -> None:
    from ..mil.blob import blob_chunks  # noqa: PLC0415 - sibling module

    seen = set()
    for st in func.body:
        for arg in st.operands().values():
            if isinstance(arg, BlobRef) and arg.path not in seen and arg.path in weights:
                seen.add(arg.path)
                n = len(blob_chunks(weights[arg.path], source=arg.path))
                if n > 1:
                    raise CompileError(node_name(st), f"blob file {arg.path} holds {n} chunks; "
                                       "this profile accepts single-chunk blob files only",
                                       "write one blob file per tensor")
