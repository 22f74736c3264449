"""Fluent graph construction: one method per op, composites built from ANE-safe pieces.

    b = GraphBuilder("ffn")
    x = b.input("x", [1, 64, 1, 32])                 # BC1S: [batch, channels, 1, sequence]
    h = b.linear(x, w1, name="w1")                   # 1x1 conv, weight [out, in] -> [out, in, 1, 1]
    b.output("y", b.silu(h) * b.linear(x, w3, name="w3"))
    graph = b.build()

Names are readable and deterministic: the `name` given, else the op name, with `_1`, `_2`
appended on collision. Operand consts are named `<node>_<arg>` (a scalar `y` of node `scale`
is `scale_y`); composite helpers name their steps `<prefix>_<suffix>` (as Orion's composite
builders do). Python numbers and numpy arrays are accepted wherever a tensor operand is, and become consts
of the other operand's dtype. Passes use `GraphBuilder.on(graph)` to add nodes to a graph.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..errors import ShapeError
from ..fp16.bits import to_half
from ..mil.program import TensorType
from .graph import Graph, Value, np_dtype

INLINE_MAX = 16  # elements: larger consts go to a BLOBFILE, smaller ones are written inline
GELU_C, GELU_CUBIC = math.sqrt(2.0 / math.pi), 0.044715  # GELU's tanh form: u = c·(x + 0.044715·x³)


class GraphBuilder:
    def __init__(self, name: str = "main", graph: Graph | None = None):
        self.graph = graph if graph is not None else Graph(name)

    @classmethod
    def on(cls, graph: Graph) -> "GraphBuilder":
        """A builder that appends to an existing graph (for rewrites; topo-sort afterwards)."""
        return cls(graph=graph)

    # --- values --------------------------------------------------------------------------
    def _wrap(self, v: Value) -> Value:
        v.builder = self
        return v

    def input(self, name: str, shape: Sequence[int], dtype: str = "fp16") -> Value:
        np_dtype(dtype)  # validates the dtype name
        return self._wrap(self.graph.add_input(name, TensorType(dtype, tuple(int(d) for d in shape))))

    def const(self, array, name: str | None = None, dtype: str | None = None,
              blob: bool | None = None) -> Value:
        """A const; inline when small (scalars, int vectors), else a BLOBFILE unless `blob` says."""
        arr = np.asarray(array)
        if dtype == "fp16" and arr.dtype == np.float16 and arr.flags.c_contiguous:
            arr = arr.view()  # already fp16 (a runner's folded weights): shared, never written
            arr.flags.writeable = False
        elif dtype == "fp16":
            arr = to_half(arr)  # numpy's cast, bit for bit, at memory speed
        elif dtype is not None:
            arr = arr.astype(np_dtype(dtype))
        elif arr.dtype == np.float64:
            arr = arr.astype(np.float16)  # Python floats default to the ANE's compute dtype
        elif arr.dtype == np.int64:
            arr = arr.astype(np.int32)
        if blob is None:
            blob = arr.size > INLINE_MAX and arr.dtype.kind == "f"
        return self._wrap(self.graph.add_const(arr, name or "const", blob=blob))

    def weight(self, name: str, array, dtype: str = "fp16") -> Value:
        """A weight const: always a BLOBFILE, one tensor per file (as maderix/ANE's training writes)."""
        return self.const(array, name=name, dtype=dtype, blob=True)

    def scalar(self, v: float | int | bool, dtype: str = "fp16", name: str | None = None) -> Value:
        return self.const(np.array(v, dtype=np_dtype(dtype)), name=name or "scalar", blob=False)

    def _operand(self, v: Any, like: Value | None, name: str) -> Value:
        if isinstance(v, Value):
            return v
        arr = np.asarray(v)
        # floats follow the other operand's dtype; bool masks and int vectors keep their kind
        dtype = like.dtype if like is not None and arr.dtype.kind == "f" else None
        if arr.ndim == 0:
            return self.scalar(arr.item(), dtype or "fp16", name=name)
        return self.const(arr, name=name, dtype=dtype)

    # --- generic node creation -----------------------------------------------------------
    def op(self, op: str, inputs: dict[str, Any], params: dict[str, Any] | None = None,
           name: str | None = None) -> Value:
        """Add one node; non-Value operands become consts named `<node>_<arg>`."""
        node_name = self.graph.peek_name(name or op)
        like = next((v for v in _flat(inputs.values()) if isinstance(v, Value)), None)
        ins: dict[str, Any] = {}
        for arg, v in inputs.items():
            if v is None:
                continue  # optional operand left out (conv bias, sdpa mask)
            if isinstance(v, (tuple, list)):
                ins[arg] = tuple(self._operand(i, like, f"{node_name}_{arg}{k}") for k, i in enumerate(v))
            else:
                ins[arg] = self._operand(v, like, f"{node_name}_{arg}")
        node = self.graph.add_node(op, ins, params or {}, name=node_name)
        return self._wrap(node.out)

    # --- elementwise ---------------------------------------------------------------------
    def add(self, x, y, name=None): return self.op("add", {"x": x, "y": y}, name=name)
    def sub(self, x, y, name=None): return self.op("sub", {"x": x, "y": y}, name=name)
    def mul(self, x, y, name=None): return self.op("mul", {"x": x, "y": y}, name=name)
    def real_div(self, x, y, name=None): return self.op("real_div", {"x": x, "y": y}, name=name)
    def pow(self, x, y, name=None): return self.op("pow", {"x": x, "y": y}, name=name)
    def maximum(self, x, y, name=None): return self.op("maximum", {"x": x, "y": y}, name=name)
    def minimum(self, x, y, name=None): return self.op("minimum", {"x": x, "y": y}, name=name)
    def abs(self, x, name=None): return self.op("abs", {"x": x}, name=name)
    def sqrt(self, x, name=None): return self.op("sqrt", {"x": x}, name=name)
    def exp(self, x, name=None): return self.op("exp", {"x": x}, name=name)
    def tanh(self, x, name=None): return self.op("tanh", {"x": x}, name=name)
    def sigmoid(self, x, name=None): return self.op("sigmoid", {"x": x}, name=name)
    def silu(self, x, name=None): return self.op("silu", {"x": x}, name=name)
    def relu(self, x, name=None): return self.op("relu", {"x": x}, name=name)
    def identity(self, x, name=None): return self.op("identity", {"x": x}, name=name)

    def rsqrt(self, x, epsilon: float | None = None, name=None):
        return self.op("rsqrt", {"x": x}, {} if epsilon is None else {"epsilon": epsilon}, name=name)

    def gelu(self, x, mode: str = "TANH_APPROXIMATION", name=None):
        # tanh form by default: it is what GPT-2 uses and what the compiler decomposes exactly
        return self.op("gelu", {"x": x}, {"mode": mode}, name=name)

    def clip(self, x, alpha: float, beta: float, name=None):
        return self.op("clip", {"x": x}, {"alpha": float(alpha), "beta": float(beta)}, name=name)

    def cast(self, x, dtype: str, name=None):
        return self.op("cast", {"x": x}, {"dtype": dtype}, name=name)

    # --- linear --------------------------------------------------------------------------
    def conv(self, x: Value, weight, bias=None, strides=(1, 1), pad_type: str = "valid",
             pad=(0, 0, 0, 0), dilations=(1, 1), groups: int = 1, name=None) -> Value:
        """conv with every param explicit, as the references emit it (maderix/ANE's MIL generators)."""
        n = self.graph.peek_name(name or "conv")
        if not isinstance(weight, Value):
            w = np.asarray(weight)
            weight = self.weight(f"{n}_weight", w.reshape(*w.shape, 1, 1) if w.ndim == 2 else w, x.dtype)
        if bias is not None and not isinstance(bias, Value):
            bias = self.weight(f"{n}_bias", np.asarray(bias).reshape(-1), x.dtype)
        params = {"strides": list(strides), "pad_type": pad_type, "pad": list(pad),
                  "dilations": list(dilations), "groups": int(groups)}
        return self.op("conv", {"x": x, "weight": weight, "bias": bias}, params, name=n)

    def linear(self, x: Value, w, b=None, name: str = "linear") -> Value:
        """y = W x (+ b) on BC1S as a 1x1 conv; a bias is a separate add (ANE conv has none)."""
        n = self.graph.peek_name(name)
        if b is None:
            return self.conv(x, w, name=n)
        y = self.conv(x, w, name=f"{n}_conv")
        bias = b if isinstance(b, Value) else self.weight(f"{n}_bias", np.asarray(b).reshape(1, -1, 1, 1), x.dtype)
        return self.add(y, bias, name=n)

    def matmul(self, x, y, transpose_x: bool = False, transpose_y: bool = False, name=None):
        return self.op("matmul", {"x": x, "y": y},
                       {"transpose_x": bool(transpose_x), "transpose_y": bool(transpose_y)}, name=name)

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, name=None):
        ins = {"query": query, "key": key, "value": value, "attn_mask": attn_mask}
        return self.op("scaled_dot_product_attention", ins, name=name or "sdpa")

    # --- reductions and normalisation ----------------------------------------------------
    def softmax(self, x, axis: int = -1, name=None):
        return self.op("softmax", {"x": x}, {"axis": int(axis)}, name=name)

    def _reduce(self, op, x, axes, keep_dims, name):
        # keep_dims defaults to True here: BC1S tensors stay rank 4 (ml-ane-transformers)
        return self.op(op, {"x": x}, {"axes": [int(a) for a in _seq(axes)], "keep_dims": bool(keep_dims)},
                       name=name)

    def reduce_sum(self, x, axes=(1,), keep_dims=True, name=None):
        return self._reduce("reduce_sum", x, axes, keep_dims, name)

    def reduce_mean(self, x, axes=(1,), keep_dims=True, name=None):
        return self._reduce("reduce_mean", x, axes, keep_dims, name)

    def reduce_max(self, x, axes=(1,), keep_dims=True, name=None):
        return self._reduce("reduce_max", x, axes, keep_dims, name)

    def layer_norm(self, x, axes=(1,), gamma=None, beta=None, epsilon: float = 1e-5, name=None):
        n = self.graph.peek_name(name or "layer_norm")
        g = gamma if gamma is None or isinstance(gamma, Value) else self.weight(f"{n}_gamma", gamma, x.dtype)
        bt = beta if beta is None or isinstance(beta, Value) else self.weight(f"{n}_beta", beta, x.dtype)
        params = {"axes": [int(a) for a in _seq(axes)], "epsilon": float(epsilon)}
        return self.op("layer_norm", {"x": x, "gamma": g, "beta": bt}, params, name=n)

    # --- movement ------------------------------------------------------------------------
    def reshape(self, x, shape, name=None):
        return self.op("reshape", {"x": x}, {"shape": [int(d) for d in shape]}, name=name)

    def transpose(self, x, perm, name=None):
        return self.op("transpose", {"x": x}, {"perm": [int(d) for d in perm]}, name=name)

    def slice_by_size(self, x, begin, size, name=None):
        return self.op("slice_by_size", {"x": x}, {"begin": [int(d) for d in begin],
                                                   "size": [int(d) for d in size]}, name=name)

    def slice_by_index(self, x, begin, end, stride=None, begin_mask=None, end_mask=None,
                       squeeze_mask=None, name=None):
        p = {"begin": [int(d) for d in begin], "end": [int(d) for d in end]}
        for k, v in (("stride", stride), ("begin_mask", begin_mask), ("end_mask", end_mask),
                     ("squeeze_mask", squeeze_mask)):
            if v is not None:
                p[k] = [bool(i) for i in v] if k.endswith("mask") else [int(i) for i in v]
        return self.op("slice_by_index", {"x": x}, p, name=name)

    def concat(self, values: Sequence[Value], axis: int, interleave: bool = False, name=None):
        return self.op("concat", {"values": tuple(values)},
                       {"axis": int(axis), "interleave": bool(interleave)}, name=name)

    # --- quantization --------------------------------------------------------------------
    def quantize(self, x, scale, zero_point=None, axis: int | None = None,
                 output_dtype: str = "int8", name=None):
        n = self.graph.peek_name(name or "quantize")
        zp = None if zero_point is None else self._operand_typed(zero_point, output_dtype, f"{n}_zero_point")
        p: dict[str, Any] = {"output_dtype": output_dtype}
        if axis is not None:
            p["axis"] = int(axis)
        return self.op("quantize", {"input": x, "scale": self._operand_typed(scale, x.dtype, f"{n}_scale"),
                                    "zero_point": zp}, p, name=n)

    def dequantize(self, x, scale, zero_point=None, axis: int | None = None, dtype: str = "fp16", name=None):
        n = self.graph.peek_name(name or "dequantize")
        zp = None if zero_point is None else self._operand_typed(zero_point, x.dtype, f"{n}_zero_point")
        ins = {"input": x, "scale": self._operand_typed(scale, dtype, f"{n}_scale"), "zero_point": zp}
        return self.op("dequantize", ins, {} if axis is None else {"axis": int(axis)}, name=n)

    def constexpr_affine_dequantize(self, quantized_data, scale, zero_point=0, axis: int = 0,
                                    dtype: str = "fp16", name=None):
        """A weight stored as int8 in a BLOBFILE, dequantized when the program is compiled."""
        n = self.graph.peek_name(name or "dequantized")
        q = np.asarray(quantized_data)
        qdata = self.const(q, name=f"{n}_quantized_data", dtype="int8", blob=True)
        ins = {"quantized_data": qdata, "scale": self._operand_typed(scale, dtype, f"{n}_scale"),
               "zero_point": self._operand_typed(zero_point, "int8", f"{n}_zero_point")}
        return self.op("constexpr_affine_dequantize", ins, {"axis": int(axis)}, name=n)

    def constexpr_blockwise_shift_scale(self, data, data_dtype: str, scale, offset=None, name=None) -> Value:
        """A weight stored as `data_dtype` (int4/uint4 packed, or int8/uint8) in a BLOBFILE with
        per-block fp16 scales (and offsets: `data_dtype` integers, or fp16), made dense when the
        program is compiled (iOS 18; ops_quant). `data_dtype` is int4, uint4 or int8: the graph
        holds the values in an int8 array (0..15 fit) and the const's type says how they are stored."""
        if data_dtype not in ("int4", "uint4", "int8"):
            raise ShapeError(f"blockwise data dtype {data_dtype!r}; expected int4, uint4 or int8")
        n = self.graph.peek_name(name or "blockwise")
        d = self.const(np.asarray(data).astype(np.int8), name=f"{n}_data", blob=True)
        d.type = TensorType(data_dtype, d.type.shape)
        ins = {"data": d, "scale": self.weight(f"{n}_scale", scale)}
        if offset is not None:
            off = np.asarray(offset)
            if off.dtype.kind == "f":
                ins["offset"] = self.weight(f"{n}_offset", off)
            else:
                ins["offset"] = self.const(off.astype(np.int8), name=f"{n}_offset", blob=True)
                ins["offset"].type = TensorType(data_dtype, ins["offset"].type.shape)
        return self.op("constexpr_blockwise_shift_scale", ins, {}, name=n)

    def constexpr_lut_to_dense(self, indices, indices_dtype: str, lut, name=None) -> Value:
        """A palettized weight: `indices_dtype` (uint1..uint6, packed in the BLOBFILE) into fp16
        tables `lut` of rank indices' + 2 (`[..blocks.., 2^bits, 1]`), made dense when the program
        is compiled (iOS 18; ops_quant). The graph holds sub-byte indices in an int8 array (0..63 fit)."""
        if indices_dtype not in ("uint1", "uint2", "uint3", "uint4", "uint6"):
            raise ShapeError(f"palettized indices dtype {indices_dtype!r}; expected uint1, uint2, uint3, "
                             "uint4 or uint6")
        n = self.graph.peek_name(name or "palettized")
        d = self.const(np.asarray(indices).astype(np.int8), name=f"{n}_indices", blob=True)
        d.type = TensorType(indices_dtype, d.type.shape)
        return self.op("constexpr_lut_to_dense", {"indices": d, "lut": self.weight(f"{n}_lut", lut)}, {}, name=n)

    def _operand_typed(self, v, dtype: str, name: str) -> Value:
        if isinstance(v, Value):
            return v
        arr = np.asarray(v, dtype=np_dtype(dtype))
        return self.const(arr, name=name, blob=False) if arr.ndim == 0 or arr.size <= INLINE_MAX \
            else self.const(arr, name=name, blob=True)

    # --- composites ----------------------------------------------------------------------
    def layer_norm_decomposed(self, x: Value, gamma=None, beta=None, eps: float = 1e-5,
                              axes: Sequence[int] = (1,), name: str = "ln") -> Value:
        """LayerNorm over `axes` with means as reduce_sum × 1/N (the conservative
        form); the decompose pass writes MIL's `layer_norm` this way. `gamma`/`beta` are
        arrays of the normalised shape, or Values that broadcast against x."""
        p = self.graph.peek_name(name)
        axes = sorted(a % x.rank for a in axes)
        shape = [x.shape[a] if a in axes else 1 for a in range(x.rank)]
        if gamma is not None and not isinstance(gamma, Value):
            gamma = self.weight(f"{p}_g", np.reshape(gamma, shape), x.dtype)
        if beta is not None and not isinstance(beta, Value):
            beta = self.weight(f"{p}_b", np.reshape(beta, shape), x.dtype)
        inv = self.scalar(1.0 / int(np.prod([x.shape[a] for a in axes])), x.dtype, f"{p}_invn")
        mean = self.mul(self.reduce_sum(x, axes=axes, name=f"{p}_sum"), inv, name=f"{p}_mean")
        cent = self.sub(x, mean, name=f"{p}_cent")
        var = self.mul(self.reduce_sum(self.mul(cent, cent, name=f"{p}_sq"), axes=axes, name=f"{p}_sqsum"),
                       inv, name=f"{p}_var")
        veps = self.add(var, self.scalar(eps, x.dtype, f"{p}_eps"), name=f"{p}_veps")
        rstd = self.pow(veps, self.scalar(-0.5, x.dtype, f"{p}_nhalf"), name=f"{p}_rstd")
        out = self.mul(cent, rstd, name=f"{p}_norm" if gamma is not None or beta is not None else p)
        if gamma is not None:
            out = self.mul(out, gamma, name=f"{p}_scaled" if beta is not None else p)
        if beta is not None:
            out = self.add(out, beta, name=p)
        return out

    def gelu_tanh(self, x: Value, name: str = "gelu", as_sigmoid: bool = False) -> Value:
        """0.5·x·(1 + tanh u), u = √(2/π)·(x + 0.044715·x³), from mul/add/tanh (exact √(2/π),
        not 0.7979): the form the decompose pass gives MIL's `gelu`.

        `as_sigmoid` writes the same function as x·sigmoid(2u), 2u = x·(2c + 2c·0.044715·x²), in
        six ops instead of nine: the device kernels' form, where every op costs a pass."""
        p = self.graph.peek_name(name)
        if as_sigmoid:
            x2 = self.mul(x, x, name=f"{p}_x2")
            inner = self.add(self.mul(x2, 2 * GELU_C * GELU_CUBIC, name=f"{p}_a"), 2 * GELU_C, name=f"{p}_b")
            return self.mul(x, self.sigmoid(self.mul(x, inner, name=f"{p}_2u"), name=f"{p}_sig"), name=p)
        x3 = self.mul(self.mul(x, x, name=f"{p}_x2"), x, name=f"{p}_x3")
        inner = self.add(x, self.mul(x3, GELU_CUBIC, name=f"{p}_cx3"), name=f"{p}_inner")
        th = self.tanh(self.mul(inner, GELU_C, name=f"{p}_scaled"), name=f"{p}_th")
        return self.mul(self.mul(x, 0.5, name=f"{p}_hx"), self.add(th, 1.0, name=f"{p}_onep"), name=p)

    # --- finishing -----------------------------------------------------------------------
    def output(self, name: str, value: Value) -> Value:
        """Return `value` as `name`; the value takes that name when it is free to (MIL var == name)."""
        if not isinstance(value, Value):
            raise ShapeError(f"output '{name}': expected a Value, got {type(value).__name__}")
        if name in self.graph.outputs:
            raise ShapeError(f"output '{name}' is declared twice")
        g = self.graph
        if name not in g._taken and not g.is_input(value) and not g.is_output(value):
            g.rename(value, name)
        g.outputs[name] = value
        return value

    def build(self) -> Graph:
        self.graph.topo_sort()
        return self.graph


def _flat(vals):
    for v in vals:
        if isinstance(v, (tuple, list)):
            yield from v
        else:
            yield v


def _seq(v) -> list:
    return list(v) if isinstance(v, (list, tuple, np.ndarray)) else [v]
