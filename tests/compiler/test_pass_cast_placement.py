"""cast_placement: under strict, casts only on inputs or returned values."""

import pytest

from anelm.compiler.registry import run_pass
from anelm.chip.profile import STRICT
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder


def boundary_graph():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8], "fp32")
    h = b.relu(b.cast(x, "fp16", name="x16"))
    b.output("y", b.cast(h, "fp32"))
    return b.build()


def test_boundary_casts_pass():
    g = boundary_graph()
    assert not run_pass("cast_placement", g)
    assert g.op_list() == ["cast", "relu", "cast"]


def test_inner_cast_is_rejected_with_node_constraint_and_fix():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    mid = b.cast(b.relu(x), "fp32", name="mid")
    b.output("y", b.cast(b.exp(mid), "fp16"))
    g = b.build()
    with pytest.raises(CompileError) as e:
        run_pass("cast_placement", g)
    assert e.value.node == "mid" and "function input" in e.value.constraint and "fp16" in e.value.fix


def test_profile_switch_off_allows_inner_casts():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 8])
    b.output("y", b.exp(b.cast(b.relu(x), "fp32")))
    g = b.build()
    assert not run_pass("cast_placement", g, STRICT.replace(cast_only_at_boundary=False))
