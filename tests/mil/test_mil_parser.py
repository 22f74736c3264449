"""The MIL parser: both dialects (docs/architecture.md), exact error positions, and print/parse round trips."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anelm.errors import MILSyntaxError
from anelm.mil.parser import parse
from anelm.mil.program import BlobRef, Function, Literal, Program, Statement, TensorType, Var
from anelm.mil.text import print_program

SHARED = Path(__file__).resolve().parents[2].parent / "shared"


def conformance(case: str) -> str:
    path = SHARED / "data" / "mil-conformance" / case / "model.mil"
    if not path.exists():
        pytest.skip("../shared absent: external fixtures are not part of a user's clone")
    return path.read_text()


def wrap(stmt: str, outputs: str = "c") -> str:
    """A one-statement program around `stmt`."""
    return f"program(1.3)\n{{\n    func main<ios18>() {{\n        {stmt}\n    }} -> ({outputs});\n}}\n"


def attr_values(prog: Program) -> dict:
    """Statement name -> {operand: python value}, for dialect-independent comparisons."""

    def plain(v):
        if isinstance(v, Literal):
            return v.value if isinstance(v.value, str) else v.value.tolist()
        return v

    return {s.name: {k: plain(v) for k, v in s.operands().items()} for s in prog.main.body}


# ----------------------------------------------------------------------------- conformance files


def test_conformance_attention():
    prog = parse(conformance("causal_attention_decomposed"))
    fn = prog.main
    assert prog.version == "1.3" and fn.opset == "ios18" and fn.outputs == ["o"]
    assert [n for _, n in fn.inputs] == ["v", "q", "k"]  # declaration order, not alphabetical
    assert fn.inputs[0][0] == TensorType("fp16", (1, 4, 64, 32))
    by_name = {s.name: s for s in fn.body}
    assert by_name["cm"].attrs["val"] == BlobRef(TensorType("fp16", (1, 1, 64, 64)), "@model_path/weights/mask.bin", 64)
    scl = by_name["scl"].attrs["val"]
    assert scl.type == TensorType("fp16", None) and scl.value.dtype == np.float16 and scl.value == np.float16(0.176777)
    assert by_name["sax"].attrs["val"].value == -1
    qk = by_name["qk"]
    assert qk.results == [(TensorType("fp16", (1, 4, 64, 64)), "sc")] and qk.op == "matmul"
    assert qk.args == {"transpose_x": Var("tF"), "transpose_y": Var("tT"), "x": Var("q"), "y": Var("k")}
    assert prog.build_info[0] == ("coremlc-component-MIL", "3510.2.1") and prog.build_info[2][1] == ""


@pytest.mark.parametrize("case, n_body, outputs", [
    ("dyn_matmul", 17, ["y"]), ("reduce_max_softmax_channels", 5, ["probs", "mx"]),
    ("swiglu_three_outputs", 12, ["h3", "gate", "h1"]), ("causal_attention_decomposed", 10, ["o"]),
])
def test_every_conformance_file_parses(case, n_body, outputs):
    fn = parse(conformance(case)).main
    assert len(fn.body) == n_body and fn.outputs == outputs
    for s in fn.body:
        if s.op == "const" and isinstance(s.attrs["val"], Literal):
            val = s.attrs["val"]
            assert s.results[0][0] == val.type and np.shape(val.value) == (val.type.shape or ())


def test_conformance_int_vectors():
    vals = attr_values(parse(conformance("dyn_matmul")))
    assert vals["bw"]["val"] == [0, 0, 0, 128] and vals["pm"]["val"] == [0, 1, 3, 2]


# ----------------------------------------------------------------------------- dialects

OURS = """program(1.3)
[buildInfo = dict<string, string>({{"coremlc-version", "3505.4.1"}})]
{
    func main<ios18>(tensor<fp16, [1, 4, 8]> A) {
        bool ff = const()[name = string("ff"), val = bool(false)];
        int32 ax = const()[name = string("ax"), val = int32(-1)];
        fp16 sc = const()[name = string("sc"), val = fp16(0x1p-3)];
        string pt = const()[name = string("pt"), val = string("valid")];
        tensor<fp16, [8, 8, 1, 1]> W = const()[name = string("W"), val = tensor<fp16, [8, 8, 1, 1]>(BLOBFILE(path = string("@model_path/weights/W.bin"), offset = uint64(64)))];
    } -> (A);
}
"""
OLD = """program(1.0)
[buildInfo = dict<tensor<string, []>, tensor<string, []>>({{"coremlc-version", "3505.4.1"}})]
{
  func main<ios16>(tensor<fp16,[1,4,8]> A) {
    tensor<bool,[]> ff=const()[name=tensor<string,[]>("ff"),val=tensor<bool,[]>(false)];
    tensor<int32, []> ax = const()[name = tensor<string, []>("ax"), val = tensor<int32, []>(-1)];
    tensor<fp16, []> sc = const()[name = tensor<string, []>("sc"), val = tensor<fp16, []>(0.125)];
    tensor<string, []> pt = const()[name = tensor<string, []>("pt"), val = tensor<string, []>("valid")];
    tensor<fp16, [8, 8, 1, 1]> W = const()[name = tensor<string, []>("W"), val = tensor<fp16, [8, 8, 1, 1]>(BLOBFILE(path = tensor<string, []>("@model_path/weights/W.bin"), offset = tensor<uint64, []>(64)))]  ;
  } -> (A);
}
"""


def test_both_dialects_mean_the_same():
    ours, old = parse(OURS), parse(OLD)
    assert (ours.version, old.version) == ("1.3", "1.0")
    assert (ours.main.opset, old.main.opset) == ("ios18", "ios16")
    assert ours.build_info == old.build_info == [("coremlc-version", "3505.4.1")]
    assert attr_values(ours) == attr_values(old) == {
        "ff": {"val": False}, "ax": {"val": -1}, "sc": {"val": 0.125}, "pt": {"val": "valid"},
        "W": {"val": BlobRef(TensorType("fp16", (8, 8, 1, 1)), "@model_path/weights/W.bin", 64)}}
    # scalars stay scalars in ours, rank-0 tensors in the old dialect
    assert ours.main.body[1].results[0][0] == TensorType("int32", None)
    assert old.main.body[1].results[0][0] == TensorType("int32", ())
    assert old.main.body[1].attrs["val"].value.dtype == np.int32


def test_coreml8_opset_and_program_1():
    fn = parse("program(1)\n{\n  func main<CoreML8>() {\n  } -> ();\n}\n").main
    assert fn.opset == "CoreML8" and fn.inputs == [] and fn.outputs == []


def test_multi_result_tuples_comments_and_functions():
    text = """program(1.3) // header comment
{
    func main<ios18>(tensor<fp16, [1, 4, 8]> x) {
        tensor<fp16, [1, 2, 8]> a, tensor<fp16, [1, 2, 8]> b = split(x = x, num_splits = int32(2), axis = int32(1))[name = string("sp")]; // two results
        tensor<fp16, [1, 4, 8]> c = concat(values = (a, b), axis = int32(1), interleave = bool(false))[name = string("c")];
        tensor<fp16, [2]> k = const()[name = string("k"), val = tensor<fp16, [2]>([-inf, -0x1.8p+1])];
    } -> (c);
    func second<ios18>(fp32 s) {
    } -> (s);
}
"""
    prog = parse(text)
    split, concat, k = prog.main.body
    assert [n for _, n in split.results] == ["a", "b"] and split.op == "split"
    assert concat.args["values"] == (Var("a"), Var("b"))
    np.testing.assert_array_equal(k.attrs["val"].value, np.array([-np.inf, -3.0], np.float16))
    assert list(prog.functions) == ["main", "second"] and prog.functions["second"].inputs == [(TensorType("fp32"), "s")]


def test_constexpr_operands_in_brackets():
    stmt = "tensor<fp16, [4, 2]> W0 = constexpr_affine_dequantize()[axis = int32(0), name = string(\"W0\"), quantized_data = tensor<int8, [4, 2]>(BLOBFILE(path = string(\"@model_path/weights/q.bin\"), offset = uint64(64))), scale = fp16(0x1p-3), zero_point = int8(-3)];"
    s = parse(wrap(stmt, "W0")).main.body[0]
    assert s.args == {} and s.name == "W0"
    ops = s.operands()
    assert ops["quantized_data"] == BlobRef(TensorType("int8", (4, 2)), "@model_path/weights/q.bin", 64)
    assert ops["scale"].value == 0.125 and ops["zero_point"].value == -3 and ops["zero_point"].value.dtype == np.int8


def test_parse_is_syntax_only():
    prog = parse(wrap('fp16 y = no_such_op(x = undefined)[name = string("y")];', "nowhere"))
    assert prog.main.body[0].op == "no_such_op" and prog.main.outputs == ["nowhere"]


def test_string_escapes():
    s = parse(wrap(r'string s = const()[val = string("a\"b\\c")];', "s"))
    assert s.main.body[0].attrs["val"].value == 'a"b\\c'


# ----------------------------------------------------------------------------- errors

HEAD = "program(1.3)\n{\n    func main<ios18>(tensor<fp16, [1, 4]> x) {\n"
TAIL = "\n    } -> (y);\n}\n"


@pytest.mark.parametrize("stmt, line, col, message", [
    ('tensor<fp16, [1, 4]> y = relu(x = x)[name = string("y")]', 5, 5, "unexpected '}'; expected ';'"),
    ('tensor<fp17, [1, 4]> y = relu(x = x);', 4, 16, "unknown dtype 'fp17'"),
    ('tensor<int32, [4]> y = const()[val = tensor<int32, [4]>([1, 2, 3])];', 4, 65, "has 3 elements; expected 4"),
    ('tensor<int32, [4]> y = const()[val = tensor<int32, [4]>([1, 2,\n 3.5, 4])];', 5, 2, "expected an integer for int32, found '3.5'"),
    ('tensor<int8, [2]> y = const()[val = tensor<int8, [2]>([1, 200])];', 4, 67, "out of range"),
    ('bool y = const()[val = bool(1)];', 4, 37, "expected true or false"),
    ('int32 y = const()[val = int32(1.5)];', 4, 39, "expected an integer"),
    ('tensor<fp16, [1, ?]> y = relu(x = x);', 4, 26, "non-negative integer dimension, found '?'"),
    ('tensor<fp16> y = relu(x = x);', 4, 15, "malformed tensor type"),
    ('tensor<fp16, [1, 4]> y = relu(x = x, x = x);', 4, 46, "argument 'x' is given twice"),
    ('string y = const()[val = string("abc)];', 4, 41, "unterminated string"),
    ('tensor<fp16, [1, 4]> y = relu(x = x) @;', 4, 46, "unexpected '@'"),
    ('fp16 y = const()[val = tensor<fp16, [4]>(BLOBFILE(path = string("a")))];', 4, 50, "BLOBFILE takes path and offset"),
])
def test_error_positions(stmt, line, col, message):
    with pytest.raises(MILSyntaxError) as e:
        parse(HEAD + "        " + stmt + TAIL, source="k/model.mil")
    assert (e.value.line, e.value.column) == (line, col)
    assert message in str(e.value) and str(e.value).startswith(f"k/model.mil:{line}:{col}: ")


@pytest.mark.parametrize("text, line, col", [("", 1, 1), ("program(1.3)\n{\n", 3, 1), ("program(1.3)\n{\n}\n}", 4, 1),
                                             ("program(-1)\n{\n}\n", 1, 9)])
def test_error_positions_at_the_edges(text, line, col):
    with pytest.raises(MILSyntaxError) as e:
        parse(text)
    assert (e.value.line, e.value.column) == (line, col)


# ----------------------------------------------------------------------------- round trips

DTYPES = {"fp16": np.float16, "fp32": np.float32, "int8": np.int8, "uint8": np.uint8, "int16": np.int16,
          "int32": np.int32, "uint32": np.uint32, "bool": np.bool_}


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal element for element; floats bit for bit (so -0.0 != 0.0), any NaN equal to any NaN."""
    if a.dtype.kind != "f":
        return np.array_equal(a, b)
    nan = np.isnan(a)
    uint = f"u{a.itemsize}"
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(uint), b[~nan].view(uint))


@st.composite
def literals(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.one_of(st.none(), st.lists(st.integers(1, 3), max_size=3).map(tuple)))
    n = int(np.prod(shape)) if shape else 1
    np_t = np.dtype(DTYPES[dtype])
    if dtype in ("fp16", "fp32"):
        bits = draw(st.lists(st.integers(0, 2 ** (8 * np_t.itemsize) - 1), min_size=n, max_size=n))
        values = np.array(bits, dtype=f"u{np_t.itemsize}").view(np_t)  # every bit pattern, inf and nan too
    elif dtype == "bool":
        values = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    else:
        info = np.iinfo(np_t)
        values = np.array(draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n)), np_t)
    return Literal(TensorType(dtype, shape), values.reshape(shape or ()))


@settings(max_examples=150, deadline=None)
@given(st.lists(literals(), min_size=1, max_size=4), st.text(min_size=0, max_size=8))
def test_print_parse_round_trip(lits, name):
    body = [Statement([(lit_.type, f"c{i}")], "const", {}, {"name": Literal(TensorType("string"), name), "val": lit_})
            for i, lit_ in enumerate(lits)]
    prog = Program("1.3", [("k", name)], {"main": Function("main", "ios18", [], body, [f"c{len(lits) - 1}"])})
    text = print_program(prog)
    back = parse(text)
    assert print_program(back) == text
    for want, got in zip(lits, (s.attrs["val"] for s in back.main.body)):
        assert got.type == want.type and got.value.dtype == want.value.dtype
        assert same_values(got.value, want.value)
    assert back.main.body[0].name == name and back.build_info == [("k", name)]


def test_conformance_round_trip_is_a_fixed_point():
    for case in ("dyn_matmul", "swiglu_three_outputs", "reduce_max_softmax_channels", "causal_attention_decomposed"):
        text = print_program(parse(conformance(case)))
        assert print_program(parse(text)) == text


def test_two_thousand_statements_parse_and_print_back():
    lines = ["program(1.3)", "{", "    func main<ios18>(tensor<fp16, [1, 64, 1, 32]> x0) {"]
    for i in range(1, 401):
        lines += [f'        int32 ax{i} = const()[name = string("ax{i}"), val = int32(1)];',
                  f'        bool kd{i} = const()[name = string("kd{i}"), val = bool(true)];',
                  f'        tensor<fp16, [1, 64, 1, 32]> s{i} = mul(x = x{i - 1}, y = x{i - 1})[name = string("s{i}")];',
                  f'        tensor<int32, [4]> pm{i} = const()[name = string("pm{i}"), val = tensor<int32, [4]>([0, 1, 3, 2])];',
                  f'        tensor<fp16, [1, 64, 1, 32]> x{i} = add(x = s{i}, y = x{i - 1})[name = string("x{i}")];']
    text = "\n".join(lines + ["    } -> (x400);", "}", ""])
    prog = parse(text)  # its speed is benchmarks/bench_compiler.py's to measure, not a test's
    assert len(prog.main.body) == 2000 and print_program(prog) == text


def test_large_inline_mask_round_trips():
    mask = np.triu(np.full((1, 1, 256, 256), -65504.0, np.float16), 1)
    val = Literal(TensorType("fp16", mask.shape), mask)
    body = [Statement([(val.type, "cm")], "const", {}, {"name": Literal(TensorType("string"), "cm"), "val": val})]
    text = print_program(Program("1.3", None, {"main": Function("main", "ios18", [], body, ["cm"])}))
    got = parse(text).main.body[0].attrs["val"].value
    assert got.dtype == np.float16 and same_values(got, mask)


@pytest.mark.parametrize("literal, expected", [
    ("tensor<fp16, [3]>([0x1p-3, -0x1.8p+1, 2])", np.array([0.125, -3.0, 2.0], np.float16)),
    ("tensor<uint64, [2]>([18446744073709551615, 0])", np.array([2**64 - 1, 0], np.uint64)),
    ("tensor<fp32, [2]>([1e-45, -3.4028235e+38])", np.array([1e-45, -3.4028235e38], np.float32)),
    ("tensor<bool, [3]>([true,false , true])", np.array([True, False, True])),
    ("tensor<int32, [0]>([])", np.zeros(0, np.int32)),
])
def test_list_literal_forms(literal, expected):
    got = parse(wrap(f"fp16 c = const()[val = {literal}];")).main.body[0].attrs["val"].value
    assert got.dtype == expected.dtype and same_values(got, expected)


@pytest.mark.parametrize("literal, message", [
    ("fp16(1_000)", "expected a number for fp16, found '1_000'"),
    ("tensor<fp16, [2]>([1_0, 2])", "expected a number for fp16, found '1_0'"),
    ("tensor<uint8, [2]>([1, -1])", "uint8 value -1 is out of range"),
    ("tensor<int32, [2]>([1 2])", "expected an integer for int32, found '1 2'"),
])
def test_list_literal_errors(literal, message):
    with pytest.raises(MILSyntaxError, match=message):
        parse(wrap(f"fp16 c = const()[val = {literal}];"))
