"""The compiler's lowering step: graph -> MIL `Program` + BLOBFILE weights, in the style of the
reference programs.

    fp16 scale_y = const()[name = string("scale_y"), val = fp16(0.125)];
    bool mm_transpose_x = const()[name = string("mm_transpose_x"), val = bool(false)];
    tensor<fp16, [1, 4, 64, 64]> mm = matmul(transpose_x = mm_transpose_x, ..., x = q, y = k)[name = string("mm")];

Rules (as maderix/ANE's MIL generators and Orion's compiler/codegen.m emit MIL):
  * every param becomes a named const `<node>_<param>` emitted just before its op; matmul's
    transpose flags in particular must never be inline literals (a compile-time reject);
  * call arguments are in alphabetical order of their MIL names (conv: dilations, groups,
    pad, pad_type, strides, weight, x);
  * each result variable equals its `name` attribute;
  * a blob const gets its own file `@model_path/weights/<const name>.bin`, `offset = uint64(64)`;
  * `constexpr_*` ops take every operand inline in the attribute brackets (alphabetical,
    `name` included); consts read only by them are not emitted on their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CompileError
from ..ir.graph import Graph, Node, Value, const_type
from ..ir.ops import OP_TABLE
from ..mil.blob import encode_tensor
from ..mil.folder import WEIGHTS_DIR
from ..mil.program import DEFAULT_BUILD_INFO, BlobRef, Function, Literal, Program, Statement, TensorType, Var

BLOB_OFFSET = 64  # the metadata block of a single-tensor BLOBFILE, as coremltools writes it
OPSET = "ios18"


def emit(graph: Graph) -> tuple[Program, dict[str, bytes]]:
    """The MIL program of `graph` (function `main`) and its weights {mil_path: BLOBFILE bytes}."""
    cg = _Codegen(graph)
    for n in graph.nodes:
        cg.node(n)
    fn = Function("main", OPSET, [(v.type, v.name) for v in graph.inputs], cg.body,
                  [v.name for v in graph.outputs.values()])
    return Program("1.3", list(DEFAULT_BUILD_INFO), {"main": fn}), cg.weights


_STRING = TensorType("string")


def _string(s: str) -> Literal:
    return Literal(_STRING, s)


def _is_constexpr(op: str) -> bool:
    return op.startswith("constexpr_") or (op in OP_TABLE and OP_TABLE[op].in_attrs and op != "const")


def param_literal(value: Any, float_dtype: str = "fp16") -> Literal:
    """A Python param as a MIL literal: bool, int32, float (`float_dtype`), string, or a vector."""
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, np.ndarray):
        return Literal(const_type(value), value)
    if isinstance(value, (list, tuple)):
        arr = np.asarray(value)
        kind = arr.dtype.kind
        dtype = "bool" if kind == "b" else "int32" if kind in "iu" else float_dtype
        return Literal(TensorType(dtype, (len(value),)), arr.astype(_np(dtype)))
    if isinstance(value, (bool, np.bool_)):
        return Literal(TensorType("bool"), np.array(bool(value)))
    if isinstance(value, (int, np.integer)):
        return Literal(TensorType("int32"), np.array(int(value), dtype=np.int32))
    if isinstance(value, (float, np.floating)):
        return Literal(TensorType(float_dtype), np.array(value, dtype=_np(float_dtype)))
    raise CompileError("?", f"param value {value!r} has no MIL literal form", "use bool, int, float, str or a list")


def _np(dtype: str):
    return {"bool": np.bool_, "int32": np.int32, "fp16": np.float16, "fp32": np.float32}[dtype]


class _Codegen:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.body: list[Statement] = []
        self.weights: dict[str, bytes] = {}
        self.names = {v.name for v in graph.inputs} | {o.name for n in graph.nodes for o in n.outputs}
        self.inlined = self._inlined_consts()

    def _inlined_consts(self) -> set[int]:
        """Const nodes whose every reader is a constexpr_* op: they live in its brackets."""
        readers: dict[int, list[Node]] = {}
        for n in self.graph.nodes:
            for _, v in n.operands():
                readers.setdefault(id(v), []).append(n)
        return {id(n) for n in self.graph.nodes if n.is_const and readers.get(id(n.out))
                and all(_is_constexpr(r.op) for r in readers[id(n.out)])
                and not self.graph.is_output(n.out)}

    def node(self, n: Node) -> None:
        if n.is_const:
            if id(n) not in self.inlined:
                self.body.append(Statement([(n.out.type, n.name)], "const", {},
                                           {"name": _string(n.name), "val": self.const_value(n)}))
        elif _is_constexpr(n.op):
            self.constexpr(n)
        else:
            self.op(n)

    def const_value(self, n: Node) -> Literal | BlobRef:
        t = n.out.type
        if not n.blob:
            return Literal(t, n.value)
        path = f"{WEIGHTS_DIR}/{n.name}.bin"
        self.weights[path] = encode_tensor(n.value, t.dtype)
        return BlobRef(t, path, BLOB_OFFSET)

    def _float_dtype(self, n: Node) -> str:
        dt = next((v.dtype for _, v in n.operands() if v.dtype in ("fp16", "fp32")), None)
        return dt or (n.out.dtype if n.out.dtype in ("fp16", "fp32") else "fp16")

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def op(self, n: Node) -> None:
        args: dict[str, Any] = {}
        fdt = self._float_dtype(n)
        for p, value in sorted(n.params.items()):
            if value is None:
                continue  # MIL default ("depends on the input")
            lit = param_literal(value, fdt)
            name = self._fresh(f"{n.name}_{p}")
            self.body.append(Statement([(lit.type, name)], "const", {}, {"name": _string(name), "val": lit}))
            args[p] = Var(name)
        for arg, v in n.inputs.items():
            args[arg] = tuple(Var(i.name) for i in v) if isinstance(v, tuple) else Var(v.name)
        results = [(o.type, o.name) for o in n.outputs]
        self.body.append(Statement(results, n.op, dict(sorted(args.items())), {"name": _string(n.name)}))

    def constexpr(self, n: Node) -> None:
        attrs: dict[str, Any] = {"name": _string(n.name)}
        for arg, v in n.inputs.items():
            attrs[arg] = self._inline_operand(n, arg, v)
        attrs.update((p, param_literal(value, n.out.dtype)) for p, value in n.params.items() if value is not None)
        results = [(o.type, o.name) for o in n.outputs]
        self.body.append(Statement(results, n.op, {}, dict(sorted(attrs.items()))))

    def _inline_operand(self, n: Node, arg: str, v: Value) -> Literal | BlobRef:
        if v.producer is None or not v.producer.is_const:
            raise CompileError(n.name, f"{n.op} operand '{arg}' must be a const (it is written inline)",
                               f"make '{v.name}' a const")
        return self.const_value(v.producer)
