"""The parser's fast path (mil/parser_fast.py) reads exactly what the lark grammar reads.

Every program here is read both ways and compared field by field, literals by dtype and bit
pattern. The fast path must take the compiler's own output (or it would save nothing) and
the conformance programs written outside the project; on text it declines, `parse` gives the
grammar's answer, so the error tests of test_mil_parser.py cover it too.
"""

import numpy as np
import pytest

from anelm.compiler.pipeline import compile_graph
from anelm.mil import literals as mil_parser
from anelm.mil.parser_grammar import parse_with_grammar
from anelm.mil.parser_fast import NotFast, read_program
from anelm.mil.program import Literal
from helpers import shared_path

DIALECTS = [
    # the older coremlc dialect: rank-0 tensors as scalars, names as string tensors
    """program(1.0)
{
    func main<ios16>(tensor<fp32, [1, 4]> x) {
        tensor<fp32, []> s = const()[name = tensor<string, []>("s"), val = tensor<fp32, []>(0.5)];
        tensor<fp32, [1, 4]> y = mul(x = x, y = s)[name = tensor<string, []>("y")];
    } -> (y);
}
""",
    # several results, tuples, spaced scalars, comments, hex floats, inf, escapes, bool lists,
    # attributes past name and val, a comment inside the arguments
    """program(1.3)
[buildInfo = dict<string, string>({{"a", "1"}, {"b\\"q", ""}})]
{
    // a comment line
    func main<ios18>(tensor<fp16, [1, 8]> x, tensor<fp16, [1, 8]> w) {
        tensor<fp16, [1, 4]> a, tensor<fp16, [1, 4]> b = split(x = x, num_splits = int32(2), axis = int32( 1 ))[name = string("sp")];
        tensor<fp16, [1, 8]> c = concat(values = (a, b), axis = int32(1), interleave = bool(false))[name = string("c\\n")];
        tensor<fp32, [3]> k = const()[name = string("k"), val = tensor<fp32, [3]>([0x1.8p1, -inf, 1e-3])];
        tensor<bool, [2]> m = const()[name = string("m"), val = tensor<bool, [2]>([true, false])];
        fp16 h = const()[name = string("h"), val = fp16(-0.0)]; // trailing
        tensor<fp16, [1, 8]> d = add(x = c, y = h)[name = string("d")];
        fp16 g = const()[name = string("g"), val = fp16(2.0), note = string("after val")];
        tensor<fp16, [1, 8]> e = add(x = d, // between arguments
            y = g)[name = string("e")  ];
        tensor<fp16, [1, 8]> f = mul(x = e , y = d )[ name = string("f"), keep = bool(true)];
    } -> (d, a, f);
}
""",
]


def same(a, b, where="program") -> None:
    """a and b are the same parse result: types, names, and literal values bit for bit."""
    if isinstance(a, Literal):
        assert isinstance(b, Literal) and a.type == b.type, where
        if isinstance(a.value, str):
            assert a.value == b.value, where
        else:
            va, vb = np.asarray(a.value), np.asarray(b.value)
            assert va.dtype == vb.dtype and va.shape == vb.shape and va.tobytes() == vb.tobytes(), where
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), where
        for f in a.__dataclass_fields__:
            same(getattr(a, f), getattr(b, f), f"{where}.{f}")
    else:
        assert a == b and type(a) is type(b), where


def fast(text: str):
    return read_program(text, mil_parser.FAST)


@pytest.mark.parametrize("text", DIALECTS, ids=["coremlc-dialect", "constructs"])
def test_fast_path_reads_both_dialects_as_the_grammar(text):
    same(fast(text), parse_with_grammar(text))


def test_fast_path_reads_the_conformance_programs_as_the_grammar():
    root = shared_path("data", "mil-conformance")
    files = sorted(root.glob("*/model.mil"))
    assert files
    for path in files:
        text = path.read_text()
        same(fast(text), parse_with_grammar(text), path.parent.name)


def test_fast_path_reads_compiled_kernels_as_the_grammar():
    from anelm.kernels.blocks import decoder_layer
    from anelm.models.config import LlamaConfig
    from anelm.models.names import random_layer

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      rms_norm_eps=1e-5, max_position_embeddings=32)
    text = compile_graph(decoder_layer(cfg, random_layer(cfg, seed=0), 32, index=0)).mil_text
    same(fast(text), parse_with_grammar(text))


@pytest.mark.parametrize("bad", [
    "program(1.3)\n{\n    func main<ios18>() {\n        tensor<fp16, [2]> c = relu(x = x, x = x);\n    } -> (c);\n}\n",
    "program(1.3)\n{\n    func main<ios18>() {\n        tensor<fp17, [2]> c = relu(x = x);\n    } -> (c);\n}\n",
    "program(1.3)\n{\n    func main<ios18>() {\n        tensor<fp16, [2]> c = const()[val = tensor<fp16, [2]>([1.0])];\n    } -> (c);\n}\n",
    "program(1.3)\n{\n    func main<ios18>() {\n        tensor<fp16, [2]> c = relu(x = x,);\n    } -> (c);\n}\n",
    "program(1.3)\n{\n}\n trailing",
], ids=["repeated-argument", "unknown-dtype", "element-count", "trailing-comma", "trailing-text"])
def test_fast_path_leaves_bad_text_to_the_grammar(bad):
    with pytest.raises(NotFast):
        fast(bad)
