"""Validation against the ANE constraint catalogue, driven by the ChipProfile, and the SRAM estimate.

The profile's rules and their messages are the table in `chip/rejects.py`, which the emulator's
compile checks raise too; the rank and dimension limits and `identity` are the compiler's own.

Each broken constraint is a CompileError naming the node, the constraint (with where it is
documented) and the fix. Minimum surface sizes are not checked here: they are a property of
the allocation, which the runtime pads to the 49,152-byte minimum, so small internal tensors
are fine.
"""

from __future__ import annotations

import warnings

from ...chip.profile import SRAM_BYTES, STRICT, ChipProfile
from ...chip.rejects import reject, rejected_sqrt, rule_on
from ...errors import CompileError
from ...ir.graph import Graph, Node, Value
from ...ir.ops import OP_TABLE
from ..registry import register_pass
from .cleanup import cast_placement

MAX_RANK = 4  # BC1S; attention uses [1, H, S, D]
MAX_DIM = 16384  # any activation dim but channels (A13; 65536 on A16, as published ANE projects report)
MAX_CHANNELS = 65536  # channel extent, and any dim of a const (32000-row classifier weights compile)


@register_pass("ane_validate")
def ane_validate(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Check (no rewrite) every node and surface against the profile's rules (chip/rejects.py)."""
    if rule_on("single_input_only", profile) and len(graph.inputs) > 1:
        raise reject("single_input_only", graph.inputs[1].name, profile, count=len(graph.inputs))
    for v in graph.inputs:
        _check_value(v, v.name, const=False)
    for n in graph.nodes:
        _check_op(graph, n, profile)
        for o in n.outputs:
            # a constexpr op's operand never reaches the device as a tensor: it is folded when the
            # program is compiled (constexpr_lut_to_dense's tables are rank 6 for a rank-4 weight)
            if not (n.is_const and all(u.op.startswith("constexpr_") for u in graph.users(o) or [n])):
                _check_value(o, n.name, const=n.is_const or n.op.startswith("constexpr_"))
    _check_spatial_multiple(graph, profile)
    cast_placement(graph, profile)
    return None


def _check_op(graph: Graph, n: Node, profile: ChipProfile) -> None:
    op = n.op
    if op == "identity":  # the compiler's own rule (aneforge's op sweep): the emulator runs identity
        raise CompileError(n.name, "identity does not compile on the ANE (aneforge's op sweep)",
                           "run identity_elimination before validation")
    if op not in OP_TABLE:
        raise reject("op_table", n.name, profile, op=op)
    if op in profile.rejected_ops:
        raise reject("rejected_ops", n.name, profile, op=op)
    if op == "reduce_mean" and rule_on("reject_reduce_mean", profile):
        raise reject("reject_reduce_mean", n.name, profile)
    x = n.inputs.get("x")
    if rule_on("reject_rsqrt", profile) and rejected_sqrt(op, x.producer.op if x is not None and x.producer else None):
        raise reject("reject_rsqrt", n.name, profile, op=op)
    if op == "conv":
        _check_conv(n, profile)
    if op == "scaled_dot_product_attention" and n.inputs.get("attn_mask") is not None \
            and rule_on("sdpa_ignores_mask", profile):
        raise reject("sdpa_ignores_mask", n.name, profile)


def _check_conv(n: Node, profile: ChipProfile) -> None:
    if rule_on("reject_conv_bias", profile) and n.inputs.get("bias") is not None:
        raise reject("reject_conv_bias", n.name, profile)
    weight = n.inputs["weight"]
    w = weight.producer
    if rule_on("reject_dynamic_conv_weight", profile) and not (w is not None and (w.is_const or w.op.startswith("constexpr_"))):
        what = "a function input" if w is None else f"the result of {w.op}"
        raise reject("reject_dynamic_conv_weight", n.name, profile, weight=weight.name, what=what)


def _check_value(v: Value, node: str, const: bool) -> None:
    shape = v.shape or ()
    if len(shape) > MAX_RANK:
        raise CompileError(node, f"'{v.name}' has rank {len(shape)}; the ANE takes rank <= {MAX_RANK}",
                           "fold the extra dims into channels or sequence with a reshape")
    for i, d in enumerate(shape):
        limit = MAX_CHANNELS if const or (len(shape) == 4 and i == 1) else MAX_DIM
        if d > limit:
            what = "channel" if limit == MAX_CHANNELS else "dimension"
            raise CompileError(node, f"'{v.name}' {what} {i} is {d}, above the ANE's limit {limit}",
                               "split the tensor along that axis into several ops or programs")


def _check_spatial_multiple(graph: Graph, profile: ChipProfile) -> None:
    if not rule_on("spatial_multiple_of", profile):
        return
    m = profile.spatial_multiple_of
    for v in [*graph.inputs, *graph.outputs.values()]:
        if v.shape and v.shape[-1] % m:
            raise reject("spatial_multiple_of", v.name, profile, width=v.shape[-1], multiple=m)


@register_pass("sram_estimate")
def sram_estimate(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Annotate (no rewrite) meta["sram"]: weights bytes + the largest live activation set.

    Past SRAM_BYTES (the measured working-set threshold, anelm/data/ane_chips.json) time per
    FLOP climbs, about 30 % (libane, Orion): a warning, recorded in meta["warnings"].
    """
    weights = resident_weight_bytes(graph)
    acts = _peak_live_bytes(graph)
    est = {"weights_bytes": weights, "activation_bytes": acts, "estimate_bytes": weights + acts,
           "limit_bytes": SRAM_BYTES}
    graph.meta["sram"] = est
    if weights + acts > SRAM_BYTES:
        msg = (f"program '{graph.name}': SRAM working set ~{(weights + acts) / 2**20:.1f} MiB exceeds "
               f"the measured {SRAM_BYTES / 1e6:.2f} MB threshold (weights {weights / 2**20:.1f} MiB + activations "
               f"{acts / 2**20:.1f} MiB); expect it to run slower, or split the program")
        graph.meta.setdefault("warnings", []).append(msg)
        sram_notice(est)
    return None


def sram_notice(est: dict) -> None:
    """The notice of a program past the threshold (`meta["sram"]` = est), also for a program
    found in a store instead of compiled. One text for every program, so Python shows it once
    per process: a real model's dozens of layer kernels all pass it, their figures in their meta."""
    if est["estimate_bytes"] > est["limit_bytes"]:
        warnings.warn(f"a program's SRAM working set exceeds the measured {est['limit_bytes'] / 1e6:.3g} MB "
                      "threshold; expect such programs to run slower (each program's estimate is in its meta)",
                      stacklevel=3)


def resident_weight_bytes(graph: Graph) -> int:
    """Bytes of the consts as stored: an int8 blob at one byte an element. A `constexpr_*`
    result (the fp16 weight `constexpr_affine_dequantize` makes of an int8 blob) is not counted
    on top: it is derived from consts already counted, and counting both made an int8 program's
    weights 1.5x its fp16 twin's instead of half."""
    return sum(n.out.type.nbytes for n in graph.nodes if n.is_const)


def _is_weight(n: Node) -> bool:
    return n.is_const or n.op.startswith("constexpr_")


def _peak_live_bytes(graph: Graph) -> int:
    """Largest sum of activation bytes alive at once, walking nodes in program order."""
    last: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        for _, v in n.operands():
            last[id(v)] = i
    end = len(graph.nodes)
    for v in graph.outputs.values():
        last[id(v)] = end  # returned values live to the end
    live = {id(v): v.type.nbytes for v in graph.inputs}
    peak = total = sum(live.values())  # total: the sum over `live`, kept as it changes
    for i, n in enumerate(graph.nodes):
        if not _is_weight(n):
            for o in n.outputs:
                live[id(o)] = o.type.nbytes
                total += live[id(o)]
        peak = max(peak, total)
        for key in [k for k in live if last.get(k, -1) <= i]:
            total -= live.pop(key)  # dead after its last reader (or never read)
    return peak
