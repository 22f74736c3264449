"""One table of compile-reject rules (chip/rejects.py): the compiler's validation of a graph and
the emulator's compile checks of the same program as MIL text give the same message and fix."""

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.chip.rejects import RULES
from anelm.compiler.codegen import emit
from anelm.compiler.registry import run_pass
from anelm.device.emulator import Emulator
from anelm.errors import CompileError
from anelm.ir.builder import GraphBuilder
from anelm.mil.text import print_program

PEER = STRICT.replace(reject_reduce_mean=True, reject_rsqrt=True, spatial_multiple_of=16)


def _graph(build, width=16):
    b = GraphBuilder("rule")
    x = b.input("x", [1, 8, 1, width])
    b.output("y", build(b, x))
    return b.build()


CASES = {  # rule -> a graph that breaks it (and only it)
    "rejected_ops": lambda: _graph(lambda b, x: b.gelu(x, name="g1")),
    "reject_conv_bias": lambda: _graph(lambda b, x: b.conv(x, np.ones((4, 8, 1, 1)), bias=np.zeros(4), name="c")),
    "reject_reduce_mean": lambda: _graph(lambda b, x: b.reduce_mean(x, axes=[1], name="rm")),
    "reject_rsqrt": lambda: _graph(lambda b, x: b.rsqrt(b.exp(x), name="rs")),
    "cast_only_at_boundary": lambda: _graph(lambda b, x: b.exp(b.cast(b.relu(x), "fp32", name="mid"))),
    "spatial_multiple_of": lambda: _graph(lambda b, x: b.relu(x), width=20),
}


def _message(fn):
    with pytest.raises(CompileError) as e:
        fn()
    return e.value.node, e.value.constraint, e.value.fix


@pytest.mark.parametrize("rule", sorted(CASES))
def test_compiler_and_emulator_reject_with_the_same_message(rule):
    graph = CASES[rule]()
    from_compiler = _message(lambda: run_pass("ane_validate", graph, PEER))
    program, weights = emit(graph)
    from_emulator = _message(lambda: Emulator(PEER).compile(print_program(program), weights))
    assert from_compiler == from_emulator
    # the message is the table's: its fixed words are in it
    fixed = RULES[rule].constraint.split("{")[0]
    assert from_compiler[1].startswith(fixed), (fixed, from_compiler[1])


def test_every_rule_is_keyed_by_a_profile_field_or_always_on():
    keyed = {k for k in RULES if k not in ("op_table", "returned_name")}
    assert keyed <= set(STRICT.__dataclass_fields__)
    assert [k for k, r in RULES.items() if not r.device_rejects] == ["sdpa_ignores_mask"]
