"""Validation against the ANE constraint catalogue, driven by the ChipProfile, and the SRAM estimate.

Each broken constraint is a CompileError naming the node, the constraint (with where it is
documented) and the fix. Minimum surface sizes are not checked here: they are a property of
the allocation, which the runtime pads (strict §2.4), so small internal tensors are fine.
"""

from __future__ import annotations

import warnings

from ...chip.profile import SRAM_BYTES, STRICT, ChipProfile
from ...errors import CompileError
from ...ir.graph import Graph, Node, Value
from ...ir.ops import OP_TABLE
from ..registry import register_pass
from .cleanup import cast_placement

MAX_RANK = 4  # BC1S; attention uses [1, H, S, D]
MAX_DIM = 16384  # any activation dim but channels (A13; peer-facts 4.6)
MAX_CHANNELS = 65536  # channel extent, and any dim of a const (32000-row classifier weights compile)


@register_pass("ane_validate")
def ane_validate(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Check (no rewrite) every node and surface against the profile's constraints."""
    if profile.single_input_only and len(graph.inputs) > 1:
        raise CompileError(graph.inputs[1].name, f"profile '{profile.name}' allows one input surface, "
                           f"got {len(graph.inputs)}", "pack the inputs along the spatial axis of one input")
    for v in graph.inputs:
        _check_value(v, v.name, const=False)
    for n in graph.nodes:
        _check_op(graph, n, profile)
        for o in n.outputs:
            _check_value(o, n.name, const=n.is_const or n.op.startswith("constexpr_"))
    _check_spatial_multiple(graph, profile)
    cast_placement(graph, profile)
    return None


def _check_op(graph: Graph, n: Node, profile: ChipProfile) -> None:
    op = n.op
    if op == "identity":
        raise CompileError(n.name, "identity does not compile on the ANE (peer-facts 4.1)",
                           "run identity_elimination before validation")
    if op not in OP_TABLE:
        raise CompileError(n.name, f"op '{op}' is missing from the emulator's op table (CONTRACTS §2.1)",
                           "express it with ops the table has")
    if op in profile.rejected_ops:
        raise CompileError(n.name, f"op '{op}' is rejected by profile '{profile.name}' (CONTRACTS §2.1)",
                           "run the decompose / concat_elimination passes, or rewrite it by hand")
    if op == "reduce_mean" and profile.reject_reduce_mean:
        raise CompileError(n.name, f"profile '{profile.name}' rejects reduce_mean", "use reduce_sum × 1/N")
    if op in ("rsqrt", "sqrt") and profile.reject_rsqrt:
        raise CompileError(n.name, f"profile '{profile.name}' rejects {op}", "use pow(x, -0.5) or pow(x, 0.5)")
    if op == "conv":
        _check_conv(n, profile)
    if op == "scaled_dot_product_attention" and n.inputs.get("attn_mask") is not None and profile.sdpa_ignores_mask:
        raise CompileError(n.name, "the hardware ignores scaled_dot_product_attention's attn_mask (CONTRACTS §2.5)",
                           "decompose attention: matmul, scale, add the mask, softmax, matmul")


def _check_conv(n: Node, profile: ChipProfile) -> None:
    if profile.reject_conv_bias and n.inputs.get("bias") is not None:
        raise CompileError(n.name, "conv with a bias argument is rejected (CONTRACTS §2.1)",
                           "run conv_bias_split: conv without bias, then add a [1, C, 1, 1] const")
    w = n.inputs["weight"].producer
    if profile.reject_dynamic_conv_weight and not (w is not None and (w.is_const or w.op.startswith("constexpr_"))):
        raise CompileError(n.name, "conv weight must be a const or a constexpr_* result (CONTRACTS §2.1)",
                           "for runtime weights use matmul (the dynamic-weight pattern, maderix §4)")


def _check_value(v: Value, node: str, const: bool) -> None:
    shape = v.shape or ()
    if len(shape) > MAX_RANK:
        raise CompileError(node, f"'{v.name}' has rank {len(shape)}; the ANE takes rank <= {MAX_RANK}",
                           "fold the extra dims into channels or sequence with a reshape")
    for i, d in enumerate(shape):
        limit = MAX_CHANNELS if const or (len(shape) == 4 and i == 1) else MAX_DIM
        if d > limit:
            what = "channel" if limit == MAX_CHANNELS else "dimension"
            raise CompileError(node, f"'{v.name}' {what} {i} is {d}, above the limit {limit} (peer-facts 4.6)",
                               "split the tensor along that axis into several ops or programs")


def _check_spatial_multiple(graph: Graph, profile: ChipProfile) -> None:
    m = profile.spatial_multiple_of
    if m <= 1:
        return
    for v in [*graph.inputs, *graph.outputs.values()]:
        if v.shape and v.shape[-1] % m:
            raise CompileError(v.name, f"last dim {v.shape[-1]} is not a multiple of {m} (profile '{profile.name}')",
                               f"pad the sequence to a multiple of {m}")


@register_pass("sram_estimate")
def sram_estimate(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Annotate (no rewrite) meta["sram"]: weights bytes + the largest live activation set.

    Past SRAM_BYTES (the measured working-set threshold, anelm/data/ane_chips.json) time per
    FLOP climbs, about 30 % (peer-facts 4.6, 4.9): a warning, recorded in meta["warnings"].
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
        # one text for every program, so Python shows it once per process: a real model's
        # dozens of layer kernels all pass the threshold, and each program's figures are in its meta
        warnings.warn(f"a program's SRAM working set exceeds the measured {SRAM_BYTES / 1e6:.3g} MB threshold; "
                      "expect such programs to run slower (each program's estimate is in its meta)", stacklevel=2)
    return None


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
    peak = sum(live.values())
    for i, n in enumerate(graph.nodes):
        if not _is_weight(n):
            live.update((id(o), o.type.nbytes) for o in n.outputs)
        peak = max(peak, sum(live.values()))
        for key in [k for k in live if last.get(k, -1) <= i]:
            del live[key]  # dead after its last reader (or never read)
    return peak
