"""Codegen: named param consts, alphabetical arguments, one blob per weight, constexpr in brackets."""

import re

import numpy as np
import pytest

from anelm.ir.builder import GraphBuilder
from anelm.mil.blob import decode_blob
from anelm.compiler.codegen import emit, param_literal
from anelm.mil.parser import parse
from anelm.mil.program import DEFAULT_BUILD_INFO, BlobRef, Literal, Var
from anelm.mil.text import print_program

RNG = np.random.default_rng(7)
W = RNG.standard_normal((64, 32)).astype(np.float16)


def ffn_graph():
    b = GraphBuilder("ffn")
    x = b.input("x", [1, 32, 1, 16])
    h = b.linear(x, W, name="up")
    q = b.reshape(h, [1, 4, 16, 16], name="heads")  # [1, H, D, S]
    s = b.matmul(q, q, transpose_x=True, name="scores")  # [1, H, S, S]
    b.output("y", b.softmax(s * 0.125, axis=-1, name="sm"))
    return b.build()


def emitted(g=None):
    prog, weights = emit(g or ffn_graph())
    return prog, weights, print_program(prog)


def statement(prog, name):
    return next(st for st in prog.main.body if st.results[0][1] == name)


def test_skeleton_header_and_return():
    prog, _, text = emitted()
    assert text.startswith("program(1.3)\n[buildInfo = dict<string, string>({{\"coremlc-component-MIL\", \"3510.2.1\"}")
    assert prog.build_info == DEFAULT_BUILD_INFO
    assert "    func main<ios18>(tensor<fp16, [1, 32, 1, 16]> x) {" in text
    assert text.rstrip().endswith("} -> (y);\n}")


def test_conv_params_are_named_consts_in_alphabetical_argument_order():
    prog, _, text = emitted()
    conv = statement(prog, "up")
    assert list(conv.args) == ["dilations", "groups", "pad", "pad_type", "strides", "weight", "x"]
    assert conv.args["pad_type"] == Var("up_pad_type") and conv.args["weight"] == Var("up_weight")
    assert 'string up_pad_type = const()[name = string("up_pad_type"), val = string("valid")];' in text
    assert 'tensor<int32, [2]> up_strides = const()[name = string("up_strides"), ' \
           'val = tensor<int32, [2]>([1, 1])];' in text
    assert 'int32 up_groups = const()[name = string("up_groups"), val = int32(1)];' in text
    assert "tensor<int32, [4]> up_pad = " in text and "tensor<int32, [2]> up_dilations = " in text


def test_matmul_flags_are_named_bool_consts_never_inline():
    prog, _, text = emitted()
    mm = statement(prog, "scores")
    assert mm.args["transpose_x"] == Var("scores_transpose_x")
    assert 'bool scores_transpose_x = const()[name = string("scores_transpose_x"), val = bool(true)];' in text
    assert 'bool scores_transpose_y = const()[name = string("scores_transpose_y"), val = bool(false)];' in text
    assert not re.search(r"transpose_[xy] = bool\(", text)


def test_every_variable_equals_its_name_attribute():
    prog, _, _ = emitted()
    for st in prog.main.body:
        assert st.results[0][1] == st.name


def test_helper_consts_come_right_before_their_op():
    prog, _, _ = emitted()
    names = [st.results[0][1] for st in prog.main.body]
    i = names.index("scores")
    assert names[i - 2:i] == ["scores_transpose_x", "scores_transpose_y"]


def test_weights_one_blob_file_each_at_offset_64():
    prog, weights, text = emitted()
    assert list(weights) == ["@model_path/weights/up_weight.bin"]
    ref = statement(prog, "up_weight").attrs["val"]
    assert isinstance(ref, BlobRef) and ref.offset == 64 and ref.type.shape == (64, 32, 1, 1)
    data = decode_blob(weights[ref.path], 64, "fp16", (64, 32, 1, 1))
    np.testing.assert_array_equal(data[:, :, 0, 0], W)
    assert 'BLOBFILE(path = string("@model_path/weights/up_weight.bin"), offset = uint64(64))' in text


def test_scalars_and_int_vectors_inline():
    prog, _, text = emitted()
    assert 'fp16 mul_y = const()[name = string("mul_y"), val = fp16(0.125)];' in text
    assert 'tensor<int32, [4]> heads_shape = const()[name = string("heads_shape"), ' \
           'val = tensor<int32, [4]>([1, 4, 16, 16])];' in text
    assert "tensor<fp16, [1, 4, 16, 16]> scores = matmul(" in text


def test_constexpr_operands_sit_in_brackets():
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])
    q = RNG.integers(-127, 127, (4, 8, 1, 1)).astype(np.int8)
    w = b.constexpr_affine_dequantize(q, 0.125, 0, axis=0, name="W0")
    b.output("y", b.conv(x, w, name="c"))
    prog, weights, text = emitted(b.build())
    st = statement(prog, "W0")
    assert st.args == {} and list(st.attrs) == ["axis", "name", "quantized_data", "scale", "zero_point"]
    assert isinstance(st.attrs["quantized_data"], BlobRef) and st.attrs["scale"] == st.attrs["scale"]
    assert "W0_quantized_data = const()" not in text  # inlined, not a statement of its own
    assert "zero_point = int8(0)" in text and "axis = int32(0)" in text and "scale = fp16(0.125)" in text
    blob = weights["@model_path/weights/W0_quantized_data.bin"]
    np.testing.assert_array_equal(decode_blob(blob, 64, "int8", (4, 8, 1, 1)), q)


def test_concat_values_tuple_and_param_literal_kinds():
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])
    b.output("cat", b.concat([x, b.relu(x)], axis=1))
    _, _, text = emitted(b.build())
    assert "concat(axis = cat_axis, interleave = cat_interleave, values = (x, relu))" in text
    assert param_literal([True, False]).type.dtype == "bool"
    assert param_literal(0.5, "fp32").type.dtype == "fp32"
    assert isinstance(param_literal("fp16"), Literal) and param_literal(3).type.dtype == "int32"


def test_round_trip_through_parser():
    _, _, text = emitted()
    assert print_program(parse(text)) == text


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_float_param_follows_operand_dtype(dtype):
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16], dtype)
    b.output("cl", b.clip(x, -1.0, 1.0))
    _, _, text = emitted(b.build())
    assert f"{dtype} cl_alpha = const()" in text
