"""io_naming: alphabetical MIL names in declared order, aliases back to the user's names."""

import pytest

from anelm.compiler.registry import run_pass
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder


def swiglu_like(order=("h3", "gate", "h1")):
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    vals = {"h1": b.relu(x), "h3": b.exp(x), "gate": b.tanh(x)}
    for k in order:
        b.output(k, vals[k])
    return b.build(), vals


def test_non_alphabetical_outputs_get_order_prefixes_and_aliases():
    g, vals = swiglu_like()
    assert run_pass("io_naming", g)
    mil = [v.name for v in g.outputs.values()]
    assert mil == ["o0_h3", "o1_gate", "o2_h1"] and mil == sorted(mil)
    assert list(g.outputs) == ["h3", "gate", "h1"]  # user-facing keys unchanged
    assert g.meta["aliases"] == {"o0_h3": "h3", "o1_gate": "gate", "o2_h1": "h1"}
    assert [v.producer.name for v in g.outputs.values()] == mil  # MIL var == name attribute
    assert [v.name for v in g.inputs] == ["x"]
    assert not run_pass("io_naming", g)  # idempotent


def test_alphabetical_declaration_keeps_names_but_values_take_output_names():
    g, vals = swiglu_like(("gate", "h1", "h3"))
    vals["h1"].producer.name = vals["h1"].name = "relu_x"  # not what it is returned as
    assert run_pass("io_naming", g)
    assert [v.name for v in g.outputs.values()] == ["gate", "h1", "h3"]
    assert g.meta["aliases"] == {}


def test_inputs_prefixed_when_declared_out_of_order():
    b = GraphBuilder()
    v, q, k = (b.input(n, [1, 2, 8, 4]) for n in "vqk")
    b.output("o", b.matmul(b.softmax(b.matmul(q, k, transpose_y=True)), v))
    g = b.build()
    assert run_pass("io_naming", g)
    assert [x.name for x in g.inputs] == ["i0_v", "i1_q", "i2_k"]
    assert g.meta["aliases"] == {"i0_v": "v", "i1_q": "q", "i2_k": "k"}


def test_many_outputs_pad_the_index():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    names = [f"z{i}" for i in range(12)][::-1]
    for n in names:
        b.output(n, b.mul(x, float(len(n))))
    g = b.build()
    run_pass("io_naming", g)
    mil = [v.name for v in g.outputs.values()]
    assert mil[0] == "o00_z11" and mil == sorted(mil)


def test_profile_without_alphabetical_binding_keeps_order_free():
    g, _ = swiglu_like()
    run_pass("io_naming", g, STRICT.replace(bind_outputs_alphabetically=False))
    assert [v.name for v in g.outputs.values()] == ["h3", "gate", "h1"]


def test_returning_an_input_or_a_value_twice_is_an_error():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", x)
    with pytest.raises(CompileError, match="unchanged"):
        run_pass("io_naming", b.build())
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    r = b.relu(x)
    b.output("a", r)
    b.output("b", r)
    with pytest.raises(CompileError, match="same value"):
        run_pass("io_naming", b.build())
