"""The cost annotation: what one evaluation of the program asks of the chip.

`cost_annotate` runs last, on the final graph, and records meta["cost"]:

    flops            {"conv", "matmul", "vector", "int8"}: arithmetic by the unit that does it
    ops              [[unit, flops, operand_bytes], ...]: the conv/matmul arithmetic grouped by
                     the bytes its operands hold on chip (a conv's weight; both matmul operands),
                     which is what a chip's working-set threshold is compared with
    weight_bytes     bytes of the consts as stored, what one evaluation reads of them: int8 blobs
                     at one byte an element, 4-bit blocks (constexpr_blockwise_shift_scale) at
                     half a byte plus their fp16 scales and offsets; the dense weight a constexpr
                     op makes is not counted again (validate.resident_weight_bytes)
    io_bytes         bytes of the packed input and output tensors (what crosses DRAM at least once)
    working_set_bytes   the sram_estimate figure: weights + the largest live activation set
    vector_elements  {"elementwise", "transcendental", "softmax", "reduce", "move"}: elements
                     the ANE's vector path handles outside conv/matmul (an elementwise op's
                     output, a softmax's or reduction's input, a transpose's or concat's
                     output), which the cost model rates by class

The cost model (`anelm.bench`) turns these into time per chip; the trainer's `device_flops`
metric is the sum of `flops`. Counting rules: matmul and conv 2·(output elements)·K; softmax
5 per element (max, sub, exp, sum, div); reductions one per input element; other elementwise
ops one per output element; data movement nothing. A conv or matmul whose activation comes
from `dequantize` and whose weight from `constexpr_affine_dequantize` runs on the int8 path
(W8A8, the maderix README's M4 benchmark); weight-only int8 still computes in fp16.
"""

from __future__ import annotations

import math

from ...chip.profile import STRICT, ChipProfile
from ...ir.graph import Graph, Node
from ..registry import register_pass
from .validate import resident_weight_bytes

# constexpr_* ops make a weight when the program is compiled (or as its data streams in): no
# evaluation-time arithmetic; their stored operands are what `weight_bytes` counts
FREE_OPS = {"const", "reshape", "slice_by_size", "slice_by_index", "transpose", "identity", "cast",
            "constexpr_affine_dequantize", "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"}


def _is_int8_path(n: Node) -> bool:
    x = n.inputs.get("x")
    y = n.inputs.get("weight" if n.op == "conv" else "y")
    def made_by(v, op: str) -> bool:
        return v is not None and v.producer is not None and v.producer.op == op
    return made_by(x, "dequantize") and made_by(y, "constexpr_affine_dequantize")


def node_flops(n: Node) -> tuple[str, int]:
    """(unit, arithmetic) of one node: unit is conv, matmul, vector or int8."""
    if n.op in FREE_OPS:
        return "vector", 0
    out = math.prod(n.out.shape or ())
    if n.op == "matmul":
        xs = n.inputs["x"].shape
        flops = 2 * out * (xs[-2] if n.params.get("transpose_x") else xs[-1])
    elif n.op == "conv":
        flops = 2 * out * math.prod(n.inputs["weight"].shape[1:])
    elif n.op == "softmax":
        return "vector", 5 * out
    elif n.op.startswith("reduce_"):
        return "vector", math.prod(n.inputs["x"].shape)
    else:
        return "vector", out
    return ("int8" if _is_int8_path(n) else n.op), flops


# transposes and concats rewrite memory on the ANE (ANEForge's op catalog classes them with the
# streaming ops); reshapes and slices are taken as views
MOVE_OPS = {"transpose", "concat"}
TRANSCENDENTAL_OPS = {"exp", "exp2", "log", "sigmoid", "tanh", "silu", "gelu", "erf", "pow", "sqrt", "rsqrt",
                      "sin", "cos", "softplus", "inverse", "real_div"}


def vector_elements(graph: Graph) -> dict[str, int]:
    """Elements of the non-conv/matmul work by the class the cost model rates it at."""
    out = {"elementwise": 0, "transcendental": 0, "softmax": 0, "reduce": 0, "move": 0}
    for n in graph.nodes:
        if n.op in ("conv", "matmul") or n.is_const:
            continue
        if n.op in MOVE_OPS:
            out["move"] += math.prod(n.out.shape or ())
        elif n.op in FREE_OPS:
            continue
        elif n.op == "softmax":
            out["softmax"] += math.prod(n.out.shape or ())
        elif n.op.startswith("reduce_"):
            out["reduce"] += math.prod(n.inputs["x"].shape)
        elif n.op in TRANSCENDENTAL_OPS:
            out["transcendental"] += math.prod(n.out.shape or ())
        else:
            out["elementwise"] += math.prod(n.out.shape or ())
    return out


def flops_by_unit(graph: Graph) -> dict[str, int]:
    units = {"conv": 0, "matmul": 0, "vector": 0, "int8": 0}
    for n in graph.nodes:
        unit, f = node_flops(n)
        units[unit] += f
    return units


def _operand_bytes(n: Node) -> int:
    """Bytes an op keeps on chip: a conv streams its activation past its weight; a matmul
    holds both operands (in the dynamic pipeline the weight is one of them). A constexpr
    weight counts dense (fp16): no source says the chip keeps 4-bit or int8 weights packed in
    its working set, only that it reads them packed."""
    if n.op == "conv":
        return n.inputs["weight"].type.nbytes
    return n.inputs["x"].type.nbytes + n.inputs["y"].type.nbytes


def heavy_ops(graph: Graph) -> list[list]:
    """[[unit, flops, operand_bytes], ...] of the conv/matmul nodes, equal entries summed."""
    groups: dict[tuple[str, int], int] = {}
    for n in graph.nodes:
        if n.op in ("conv", "matmul"):
            unit, f = node_flops(n)
            key = (unit, _operand_bytes(n))
            groups[key] = groups.get(key, 0) + f
    return [[unit, f, b] for (unit, b), f in sorted(groups.items())]


def graph_flops(graph: Graph) -> int:
    """Arithmetic of one evaluation (all units), counted from the graph's ops."""
    return sum(flops_by_unit(graph).values())


def kernel_flops(artifact) -> int:
    """Arithmetic of one evaluation of a compiled kernel, as `cost_annotate` recorded it on the
    final graph: the trainer's `device_flops` adds these up."""
    return sum(artifact.meta["cost"]["flops"].values())


@register_pass("cost_annotate")
def cost_annotate(graph: Graph, profile: ChipProfile = STRICT) -> Graph | None:
    """Annotate (no rewrite) meta["cost"] for the cost model; see the module doc."""
    io = sum(v.type.nbytes for v in graph.inputs) + sum(v.type.nbytes for v in graph.outputs.values())
    graph.meta["cost"] = {
        "flops": flops_by_unit(graph),
        "ops": heavy_ops(graph),
        "weight_bytes": resident_weight_bytes(graph),
        "io_bytes": int(io),
        "working_set_bytes": int((graph.meta.get("sram") or {}).get("estimate_bytes", 0)),
        "vector_elements": vector_elements(graph),
    }
    return None
