"""Shape/dtype inference of every op in OP_TABLE, and the errors it raises."""

import pytest

from anelm.errors import ShapeError
from anelm.ir.ops import OP_TABLE, REQUIRED, infer_node
from anelm.mil.program import TensorType as T

H16 = "fp16"


def t(*shape, dtype=H16):
    return T(dtype, tuple(shape))


def shape_of(op, types, params=None):
    (out,) = OP_TABLE[op].infer(types, params or {})
    return out.dtype, out.shape


EXPECTED_OPS = {
    "const", "conv", "matmul", "add", "sub", "mul", "real_div", "pow", "sqrt", "rsqrt", "exp", "tanh",
    "sigmoid", "silu", "gelu", "relu", "softmax", "reduce_sum", "reduce_mean", "reduce_max", "reshape",
    "transpose", "slice_by_size", "slice_by_index", "concat", "cast", "clip", "maximum", "minimum",
    "layer_norm", "scaled_dot_product_attention", "quantize", "dequantize", "constexpr_affine_dequantize",
}


def test_every_required_op_is_registered_with_infer_and_compute():
    assert EXPECTED_OPS <= set(OP_TABLE)
    for name, op in OP_TABLE.items():
        assert op.name == name and op.infer and op.compute


def test_mil_argument_names_and_defaults():
    assert OP_TABLE["conv"].inputs == ("x", "weight", "bias") and "bias" in OP_TABLE["conv"].optional
    assert OP_TABLE["conv"].params["pad_type"] == "valid" and OP_TABLE["conv"].params["groups"] == 1
    assert OP_TABLE["matmul"].params == {"transpose_x": False, "transpose_y": False}
    assert OP_TABLE["gelu"].params == {"mode": "EXACT"}
    assert OP_TABLE["softmax"].params == {"axis": -1}
    assert OP_TABLE["layer_norm"].params["epsilon"] == 1e-5
    assert OP_TABLE["concat"].params["interleave"] is False and OP_TABLE["concat"].params["axis"] is REQUIRED
    assert OP_TABLE["reduce_sum"].params == {"axes": None, "keep_dims": False}
    assert OP_TABLE["rsqrt"].params == {"epsilon": 1e-12}
    assert OP_TABLE["constexpr_affine_dequantize"].in_attrs and OP_TABLE["const"].in_attrs
    assert OP_TABLE["scaled_dot_product_attention"].optional == {"attn_mask"}


@pytest.mark.parametrize("op", ["add", "sub", "mul", "real_div", "pow", "maximum", "minimum"])
def test_binary_broadcasting(op):
    assert shape_of(op, {"x": t(1, 64, 1, 32), "y": t(1, 64, 1, 1)}) == (H16, (1, 64, 1, 32))
    assert shape_of(op, {"x": t(1, 64, 1, 32), "y": T(H16, None)}) == (H16, (1, 64, 1, 32))
    assert shape_of(op, {"x": t(4, 1), "y": t(3)}) == (H16, (4, 3))
    with pytest.raises(ShapeError, match=rf"{op}: expected broadcastable shapes, got \[1, 64\] and \[1, 32\]"):
        OP_TABLE[op].infer({"x": t(1, 64), "y": t(1, 32)}, {})
    with pytest.raises(ShapeError, match="one dtype"):
        OP_TABLE[op].infer({"x": t(2), "y": t(2, dtype="fp32")}, {})


@pytest.mark.parametrize("op", ["sqrt", "rsqrt", "exp", "tanh", "sigmoid", "silu", "gelu", "relu"])
def test_unary_keeps_type_and_wants_floats(op):
    assert shape_of(op, {"x": t(2, 3, dtype="fp32")}) == ("fp32", (2, 3))
    with pytest.raises(ShapeError, match=f"{op}: expected x of dtype fp16 or fp32, got int32"):
        OP_TABLE[op].infer({"x": t(2, dtype="int32")}, {})


def test_gelu_mode_and_clip_and_cast():
    assert shape_of("gelu", {"x": t(3)}, {"mode": "TANH_APPROXIMATION"}) == (H16, (3,))
    with pytest.raises(ShapeError, match="gelu: expected mode"):
        OP_TABLE["gelu"].infer({"x": t(3)}, {"mode": "FAST"})
    assert shape_of("clip", {"x": t(3)}, {"alpha": -1.0, "beta": 1.0}) == (H16, (3,))
    with pytest.raises(ShapeError, match=r"clip: expected param\(s\) \['alpha', 'beta'\]"):
        OP_TABLE["clip"].infer({"x": t(3)}, {})
    assert shape_of("cast", {"x": t(2, 2)}, {"dtype": "fp32"}) == ("fp32", (2, 2))
    with pytest.raises(ShapeError, match="cast: expected dtype among"):
        OP_TABLE["cast"].infer({"x": t(2)}, {"dtype": "fp64"})


def test_conv_shapes():
    x, w = t(1, 64, 1, 128), t(96, 64, 1, 1)
    assert shape_of("conv", {"x": x, "weight": w}) == (H16, (1, 96, 1, 128))
    assert shape_of("conv", {"x": t(1, 8, 10, 10), "weight": t(4, 2, 3, 3)},
                    {"groups": 4, "strides": [2, 2], "pad_type": "custom", "pad": [1, 1, 1, 1]}) == (H16, (1, 4, 5, 5))
    assert shape_of("conv", {"x": t(1, 4, 9, 9), "weight": t(4, 4, 3, 3)},
                    {"pad_type": "same", "strides": [2, 2]}) == (H16, (1, 4, 5, 5))
    assert shape_of("conv", {"x": t(1, 4, 16), "weight": t(2, 4, 3)}, {"dilations": [2]}) == (H16, (1, 2, 12))
    with pytest.raises(ShapeError, match=r"conv: expected weight shape\[1\] = C_in/groups = 64, got 32"):
        OP_TABLE["conv"].infer({"x": x, "weight": t(96, 32, 1, 1)}, {})
    with pytest.raises(ShapeError, match=r"conv: expected bias of shape \[96\], got \[64\]"):
        OP_TABLE["conv"].infer({"x": x, "weight": w, "bias": t(64)}, {})
    with pytest.raises(ShapeError, match="conv: expected groups dividing"):
        OP_TABLE["conv"].infer({"x": x, "weight": w}, {"groups": 5})


def test_matmul_shapes():
    q, k = t(1, 4, 64, 32), t(1, 4, 64, 32)
    assert shape_of("matmul", {"x": q, "y": k}, {"transpose_y": True}) == (H16, (1, 4, 64, 64))
    assert shape_of("matmul", {"x": q, "y": k}, {"transpose_x": True}) == (H16, (1, 4, 32, 32))
    assert shape_of("matmul", {"x": t(3, 5), "y": t(2, 1, 5, 7)}) == (H16, (2, 1, 3, 7))
    assert shape_of("matmul", {"x": t(2, 1, 3, 5), "y": t(4, 5, 6)}) == (H16, (2, 4, 3, 6))
    with pytest.raises(ShapeError, match="matmul: expected x's last dim to match y's contracting dim"):
        OP_TABLE["matmul"].infer({"x": q, "y": k}, {})
    with pytest.raises(ShapeError, match="matmul: expected broadcastable batch dims"):
        OP_TABLE["matmul"].infer({"x": t(2, 3, 5), "y": t(3, 5, 6)}, {})


def test_sdpa_shapes():
    q, k, v = t(1, 4, 16, 32), t(1, 4, 24, 32), t(1, 4, 24, 8)
    assert shape_of("scaled_dot_product_attention", {"query": q, "key": k, "value": v}) == (H16, (1, 4, 16, 8))
    mask = t(16, 24, dtype="bool")
    assert shape_of("scaled_dot_product_attention", {"query": q, "key": k, "value": v, "attn_mask": mask})[1] == (1, 4, 16, 8)
    with pytest.raises(ShapeError, match="expected key embedding E=32"):
        OP_TABLE["scaled_dot_product_attention"].infer({"query": q, "key": t(1, 4, 24, 16), "value": v}, {})
    with pytest.raises(ShapeError, match="attn_mask and"):
        OP_TABLE["scaled_dot_product_attention"].infer({"query": q, "key": k, "value": v, "attn_mask": t(16, 5)}, {})


def test_reductions_softmax_layer_norm():
    x = t(1, 512, 1, 96)
    assert shape_of("reduce_max", {"x": x}, {"axes": [1], "keep_dims": True}) == (H16, (1, 1, 1, 96))
    assert shape_of("reduce_sum", {"x": x}, {"axes": [-1, 1]}) == (H16, (1, 1))
    assert shape_of("reduce_mean", {"x": x}) == (H16, ())
    with pytest.raises(ShapeError, match=r"reduce_sum: expected axes in \[-4, 4\), got 4"):
        OP_TABLE["reduce_sum"].infer({"x": x}, {"axes": [4]})
    assert shape_of("softmax", {"x": x}, {"axis": 1}) == (H16, (1, 512, 1, 96))
    with pytest.raises(ShapeError, match="softmax: expected axis"):
        OP_TABLE["softmax"].infer({"x": x}, {"axis": 7})
    assert shape_of("layer_norm", {"x": x, "gamma": t(512)}, {"axes": [1]}) == (H16, (1, 512, 1, 96))
    with pytest.raises(ShapeError, match=r"layer_norm: expected gamma of shape x.shape\[axes\] = \[512\], got \[96\]"):
        OP_TABLE["layer_norm"].infer({"x": x, "gamma": t(96)}, {"axes": [1]})


def test_reshape_transpose():
    x = t(1, 64, 1, 128)
    assert shape_of("reshape", {"x": x}, {"shape": [1, 1, 64, 128]}) == (H16, (1, 1, 64, 128))
    assert shape_of("reshape", {"x": x}, {"shape": [1, -1, 64, 2]}) == (H16, (1, 64, 64, 2))
    assert shape_of("reshape", {"x": x}, {"shape": [0, 0, 2, -1]}) == (H16, (1, 64, 2, 64))
    with pytest.raises(ShapeError, match=r"reshape: expected a shape with the 8192 elements of \[1, 64, 1, 128\], got \[1, 3, 64, 128\]"):
        OP_TABLE["reshape"].infer({"x": x}, {"shape": [1, 3, 64, 128]})
    with pytest.raises(ShapeError, match="reshape: expected at most one -1"):
        OP_TABLE["reshape"].infer({"x": x}, {"shape": [-1, -1]})
    assert shape_of("transpose", {"x": x}, {"perm": [0, 1, 3, 2]}) == (H16, (1, 64, 128, 1))
    with pytest.raises(ShapeError, match="transpose: expected perm a permutation"):
        OP_TABLE["transpose"].infer({"x": x}, {"perm": [0, 1, 1, 2]})


def test_slices():
    x = t(1, 64, 1, 224)
    assert shape_of("slice_by_size", {"x": x}, {"begin": [0, 0, 0, 128], "size": [1, 64, 1, 96]}) == (H16, (1, 64, 1, 96))
    assert shape_of("slice_by_size", {"x": x}, {"begin": [0, 8, 0, 0], "size": [-1, -1, 1, 10]}) == (H16, (1, 56, 1, 10))
    with pytest.raises(ShapeError, match="slice_by_size: expected begin\\+size within dim 3 of size 224"):
        OP_TABLE["slice_by_size"].infer({"x": x}, {"begin": [0, 0, 0, 200], "size": [1, 64, 1, 96]})
    p = {"begin": [0, 0, 0, 1], "end": [1, 64, 1, -1], "stride": [1, 2, 1, 3]}
    assert shape_of("slice_by_index", {"x": x}, p) == (H16, (1, 32, 1, 74))
    p = {"begin": [0, 5, 0, 0], "end": [0, 0, 0, 0], "end_mask": [True, True, True, True],
         "squeeze_mask": [True, False, True, False]}
    assert shape_of("slice_by_index", {"x": x}, p) == (H16, (59, 224))
    with pytest.raises(ShapeError, match="slice_by_index: expected begin of length rank"):
        OP_TABLE["slice_by_index"].infer({"x": x}, {"begin": [0], "end": [1]})


def test_concat():
    vals = [t(1, 8, 1, 4), t(1, 3, 1, 4)]
    assert shape_of("concat", {"values": vals}, {"axis": 1}) == (H16, (1, 11, 1, 4))
    assert shape_of("concat", {"values": (t(2, 3), t(2, 3))}, {"axis": 0, "interleave": True}) == (H16, (4, 3))
    with pytest.raises(ShapeError, match="concat: expected values matching"):
        OP_TABLE["concat"].infer({"values": vals}, {"axis": 3})
    with pytest.raises(ShapeError, match="concat: expected values of one shape"):
        OP_TABLE["concat"].infer({"values": vals}, {"axis": 1, "interleave": True})


def test_quantization():
    x = t(4, 8, 1, 1)
    q = {"input": x, "scale": t(4), "zero_point": t(4, dtype="int8")}
    assert shape_of("quantize", q, {"axis": 0, "output_dtype": "int8"}) == ("int8", (4, 8, 1, 1))
    with pytest.raises(ShapeError, match=r"quantize: expected scale of length 8 \(shape\[1\]\), got 4"):
        OP_TABLE["quantize"].infer(q, {"axis": 1, "output_dtype": "int8"})
    with pytest.raises(ShapeError, match="quantize: expected zero_point of output_dtype uint8"):
        OP_TABLE["quantize"].infer(q, {"axis": 0, "output_dtype": "uint8"})
    d = {"input": t(4, 8, dtype="uint8"), "scale": T("fp32", None)}
    assert shape_of("dequantize", d) == ("fp32", (4, 8))
    c = {"quantized_data": t(512, 512, 1, 1, dtype="int8"), "scale": T(H16, None), "zero_point": T("int8", None)}
    assert shape_of("constexpr_affine_dequantize", c, {"axis": 0}) == (H16, (512, 512, 1, 1))
    with pytest.raises(ShapeError, match=r"constexpr_affine_dequantize: expected param\(s\) \['axis'\]"):
        OP_TABLE["constexpr_affine_dequantize"].infer(c, {})


def test_missing_and_unknown_operands_and_node_names():
    with pytest.raises(ShapeError, match=r"add: expected input\(s\) \['y'\]"):
        OP_TABLE["add"].infer({"x": t(2)}, {})
    with pytest.raises(ShapeError, match="softmax: expected params among"):
        OP_TABLE["softmax"].infer({"x": t(2)}, {"dim": 0})
    with pytest.raises(ShapeError, match=r"node 'mm': matmul: expected"):
        infer_node("matmul", {"x": t(2, 3), "y": t(2, 3)}, {}, node="mm")
    with pytest.raises(ShapeError, match="node 'z': op 'frobnicate' is not in the op table"):
        infer_node("frobnicate", {}, {}, node="z")
    assert shape_of("const", {"val": t(3, dtype="int32")}) == ("int32", (3,))
