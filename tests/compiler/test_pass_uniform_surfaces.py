"""uniform_surfaces: one allocation size per direction, at least the minimum surface."""

from anelm.compiler.registry import run_pass
from anelm.chip.profile import STRICT
from anelm.ir.builder import GraphBuilder


def graph():
    b = GraphBuilder()
    x = b.input("x", [1, 768, 1, 64], "fp32")  # 196,608 bytes
    s = b.input("s", [1, 4, 1, 16])  # 128 bytes
    b.output("big", b.relu(b.cast(x, "fp16")))  # 98,304 bytes
    b.output("small", b.exp(s))  # 128 bytes
    return b.build()


def test_strict_sizes_are_uniform_per_direction_and_judged_apart():
    g = graph()
    ops = g.op_list()
    assert not run_pass("uniform_surfaces", g)  # an annotation: the program is unchanged
    assert g.op_list() == ops
    assert g.meta["surface_bytes"] == {"inputs": [196608, 196608], "outputs": [98304, 98304]}


def test_minimum_surface_applies_to_small_programs():
    b = GraphBuilder()
    x = b.input("x", [1, 4, 1, 16])
    b.output("y", b.relu(x))
    g = b.build()
    run_pass("uniform_surfaces", g)
    assert g.meta["surface_bytes"] == {"inputs": [49152], "outputs": [49152]}


def test_non_uniform_profile_sizes_each_surface():
    g = graph()
    run_pass("uniform_surfaces", g, STRICT.replace(uniform_input_sizes=False, uniform_output_sizes=False,
                                                   min_surface_bytes=0))
    assert g.meta["surface_bytes"] == {"inputs": [196608, 128], "outputs": [98304, 128]}
