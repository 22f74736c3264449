"""The compiler never emits a program that breaks the `strict` profile (docs/chip-profiles.md).

Each test writes the naive graph a user would write, compiles it, and checks both the MIL
text and that the strict emulator (which rejects every violation) runs it. The emulator's
own enforcement of each rule is tested in tests/device/test_emulator_strict.py.
"""

import re

import numpy as np
import pytest

from anelm.compiler.pipeline import compile_graph
from anelm.device.base import compile_count
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from anelm.mil.parser import parse
from anelm.runtime.kernel import Kernel

RNG = np.random.default_rng(7)


def x_in(b, name="x", c=8, s=16):
    return b.input(name, [1, c, 1, s])


def run(art, **inputs):
    return Kernel(art, Emulator(STRICT))(**inputs)


def rand(c=8, s=16):
    return RNG.standard_normal((1, c, 1, s)).astype(np.float16)


def test_concat_gelu_bias_and_sdpa_never_reach_the_mil():
    b = GraphBuilder("naive")
    x = x_in(b)
    h = b.conv(x, RNG.standard_normal((8, 8, 1, 1)) * 0.3, bias=RNG.standard_normal(8))
    g = b.gelu(h, mode="EXACT")
    q = b.reshape(g, [1, 2, 16, 4], name="q")
    mask = np.triu(np.full((16, 16), -1e4, np.float32), 1)[None, None]
    a = b.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    b.output("y", b.concat([b.reshape(a, [1, 8, 1, 16], name="a"), g], axis=1))
    art = compile_graph(b.build())
    text = art.mil_text
    for banned in ("concat(", "gelu(", "scaled_dot_product_attention("):
        assert banned not in text, banned
    assert not re.search(r"conv\([^)]*bias =", text)  # the bias became a separate add
    got = run(art, x=rand())  # the strict emulator rejects any of them at compile
    assert got["y"].shape == (1, 16, 1, 16)


def test_matmul_transpose_flags_are_named_consts():
    b = GraphBuilder("mm")
    x = b.input("x", [1, 1, 16, 16])  # the 16-column spatial multiple
    b.output("y", b.matmul(x, x, transpose_y=True))
    text = compile_graph(b.build()).mil_text
    call = next(line for line in text.splitlines() if "matmul(" in line)
    assert re.search(r"transpose_x = [A-Za-z_]\w*,", call) and re.search(r"transpose_y = [A-Za-z_]\w*,", call)
    assert "bool(" not in call


def test_conv_with_a_runtime_weight_is_a_compile_error_naming_node_and_fix():
    b = GraphBuilder("dynconv")
    x = x_in(b)
    w = b.input("w", [8, 8, 1, 1])
    b.output("y", b.conv(x, w, name="proj"))
    with pytest.raises(CompileError) as e:
        compile_graph(b.build())
    msg = str(e.value)
    assert "'y'" in msg and "const" in msg and "fix" in msg  # the conv, named by its output


def test_io_is_named_so_alphabetical_binding_is_declared_order():
    b = GraphBuilder("order")
    zed, abc = x_in(b, "zed"), x_in(b, "abc")
    b.output("second", b.sub(zed, abc, name="d"))
    b.output("first", b.add(zed, abc, name="s"))
    art = compile_graph(b.build())
    fn = parse(art.mil_text).main
    names = [n for _, n in fn.inputs]
    assert names == sorted(names) and [art.meta["aliases"][n] for n in names] == ["zed", "abc"]
    assert fn.outputs == sorted(fn.outputs)
    z, a = rand(), rand()
    got = run(art, zed=z, abc=a)
    np.testing.assert_allclose(got["second"], z.astype(np.float64) - a, atol=4e-3)
    np.testing.assert_allclose(got["first"], z.astype(np.float64) + a, atol=4e-3)


def test_surfaces_are_uniform_per_direction_and_at_least_the_minimum():
    b = GraphBuilder("sizes")
    x, small = x_in(b, "x", 64, 32), x_in(b, "y", 1, 16)  # the 16-column spatial multiple
    b.output("big", b.mul(x, b.reduce_max(small, axes=[3], name="one"), name="big"))
    b.output("tiny", b.add(small, 1.0, name="tiny"))
    sig = compile_graph(b.build()).signature
    for specs in (sig.inputs, sig.outputs):
        sizes = {s.surface_bytes for s in specs}
        assert len(sizes) == 1 and sizes.pop() >= STRICT.min_surface_bytes


def test_casts_remain_only_at_the_boundary():
    b = GraphBuilder("casts")
    x = b.input("x", [1, 8, 1, 16], "fp32")
    h = b.cast(x, "fp16", name="x16")
    inner = b.cast(b.cast(b.relu(h), "fp32", name="up"), "fp16", name="down")  # a round trip
    b.output("y", b.cast(b.add(inner, 1.0, name="p1"), "fp32", name="y32"))
    art = compile_graph(b.build())
    fn = parse(art.mil_text).main
    inputs, outputs = {n for _, n in fn.inputs}, set(fn.outputs)
    for st in fn.body:
        if st.op == "cast":
            src = st.args["x"].name
            assert src in inputs or st.results[0][1] in outputs, st.results[0][1]
    got = run(art, x=rand().astype(np.float32))
    assert got["y"].dtype == np.float32


def test_identical_programs_compile_once(fresh_compile_count):
    b = GraphBuilder("once")
    b.output("y", b.relu(x_in(b)))
    art = compile_graph(b.build())
    before = compile_count()
    dev = Emulator()
    k1, k2 = Kernel(art, dev), Kernel(art, dev)
    k1(x=rand()), k2(x=rand())
    assert compile_count() - before <= 1
