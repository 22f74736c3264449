"""Grade 2: how surfaces bind and how big they must be: the strict profile's alphabetical surface
binding, uniform surface sizes and 49,152-byte minimum surface, and the peer switches
(docs/chip-profiles.md).

Binding order is read off the numbers: inputs get distinct data and the program weighs
them differently, so exactly one assignment of surfaces to names reproduces the output.
The names are declared out of alphabetical order so the two candidate rules differ.
"""

from __future__ import annotations

from itertools import permutations

import numpy as np

from ..chip.profile import ChipProfile
from .harness import ELEMENTWISE, Harness, Observation, Probe, compare, data, f64, rel_err
from .milgen import const, op, program
from .probes_ops import CH, CH_CONST, X, expect_ops

BIND_TOL = 5e-3  # four chained fp16 roundings on values up to 7: looser than one op's 2e-3
LADDER = (2048, 8192, 16384, 32768, 49152)  # surface bytes; seq=1 decode (3 KB) fails per Orion
WIDTHS = (385, 392, 400)  # last-dim multiples of 1, 8 and 16: rustane says 16 is needed


def _add_c(shape) -> str:
    return program([("x", "fp16", shape)], [CH_CONST, op("y", "fp16", shape, "add", x="x", y="c")], ["y"])


def _bind_inputs(h: Harness) -> Observation:
    declared = ("zeta", "alpha", "mid")  # not alphabetical: alpha, mid, zeta
    weight = {"zeta": 1.0, "alpha": 2.0, "mid": 4.0}
    body = [const("two", "fp16", 2.0), const("four", "fp16", 4.0),
            op("a2", "fp16", X, "mul", x="alpha", y="two"), op("m4", "fp16", X, "mul", x="mid", y="four"),
            op("s", "fp16", X, "add", x="zeta", y="a2"), op("y", "fp16", X, "add", x="s", y="m4")]
    text = program([(n, "fp16", X) for n in declared], body, ["y"])
    xs = [data(X, -1, 1, 100 + i) for i in range(3)]
    (got,) = h.run(text, xs, [("fp16", X)])
    errs = {}
    for order in permutations(declared):  # order[i] = the name surface i binds to
        errs[order] = rel_err(got, sum(weight[n] * f64(x) for n, x in zip(order, xs)))
    best = min(errs, key=errs.get)
    if errs[best] > BIND_TOL:
        return Observation("", "wrong-result", err=errs[best], tol=BIND_TOL,
                           detail="no assignment of surfaces to names reproduces the output")
    value = {tuple(sorted(declared)): "alphabetical", declared: "declared"}.get(best, "order:" + ",".join(best))
    return Observation("", "ok", value, errs[best], BIND_TOL, f"surfaces bind to {', '.join(best)}")


def _bind_outputs(h: Harness) -> Observation:
    body = [const("one", "fp16", 1.0), const("three", "fp16", 3.0),
            op("zeta", "fp16", X, "add", x="x", y="one"), op("alpha", "fp16", X, "mul", x="x", y="three")]
    text = program([("x", "fp16", X)], body, ["zeta", "alpha"])  # returned out of alphabetical order
    x = data(X, -1, 1, 7)
    got = h.run(text, [x], [("fp16", X), ("fp16", X)])
    refs = {"zeta": f64(x) + 1, "alpha": 3 * f64(x)}
    for value, order in (("alphabetical", ("alpha", "zeta")), ("declared", ("zeta", "alpha"))):
        err = max(rel_err(g, refs[n]) for g, n in zip(got, order))
        if err <= ELEMENTWISE:
            return Observation("", "ok", value, err, ELEMENTWISE, f"surfaces hold {', '.join(order)}")
    return Observation("", "wrong-result", detail="outputs match neither alphabetical nor declared order")


def _two_inputs(in_bytes=None):
    def run(h: Harness) -> Observation:
        body = [op("y", "fp16", X, "add", x="a", y="b")]  # commutative: order cannot matter
        text = program([("a", "fp16", X), ("b", "fp16", X)], body, ["y"])
        a, b = data(X, -2, 2, 21), data(X, -2, 2, 22)
        (got,) = h.run(text, [a, b], [("fp16", X)], in_bytes=in_bytes)
        return compare(got, f64(a) + f64(b), ELEMENTWISE)
    return run


def _mixed_outputs(h: Harness) -> Observation:
    body = [const("two", "fp16", 2.0), op("p", "fp16", X, "mul", x="x", y="two"), op("q", "fp16", X, "add", x="x", y="x")]
    text = program([("x", "fp16", X)], body, ["p", "q"])  # both are 2x: order cannot matter
    x = data(X, -2, 2, 23)
    got = h.run(text, [x], [("fp16", X), ("fp16", X)], out_bytes=[49152, 98304])
    return compare(np.stack(got), np.stack([2 * f64(x)] * 2), ELEMENTWISE)


def _sized(shape, in_bytes, out_bytes, seed: int):
    def run(h: Harness) -> Observation:
        x = data(shape, -4, 4, seed)
        (got,) = h.run(_add_c(shape), [x], [("fp16", shape)], in_bytes=in_bytes, out_bytes=out_bytes)
        return compare(got, f64(x) + CH.reshape(1, 64, 1, 1), ELEMENTWISE)
    return run


def _multi_input_expect(rule):
    def expect(p: ChipProfile) -> str:
        return "error" if p.single_input_only else rule(p)
    return expect


def io_probes() -> list[Probe]:
    probes = [
        Probe("bind.inputs", 2, "3 inputs declared (zeta, alpha, mid): which surface binds to which name",
              _bind_inputs, expect_ops(("mul", "add"), _multi_input_expect(
                  lambda p: "alphabetical" if p.bind_inputs_alphabetically else "declared")), ("mul", "add")),
        Probe("bind.outputs", 2, "2 outputs returned as (zeta, alpha): which surface holds which",
              _bind_outputs, expect_ops(("add", "mul"), lambda p: "alphabetical" if p.bind_outputs_alphabetically
                                        else "declared"), ("add", "mul")),
        Probe("io.single_input", 2, "a request with two same-size input surfaces (the 0x1d claim)",
              _two_inputs(), expect_ops(("add",), _multi_input_expect(lambda p: "ok")), ("add",)),
        Probe("io.mixed_input_sizes", 2, "two inputs in surfaces of 49,152 and 98,304 bytes",
              _two_inputs([49152, 98304]), expect_ops(("add",), _multi_input_expect(
                  lambda p: "error" if p.uniform_input_sizes else "ok")), ("add",)),
        Probe("io.mixed_output_sizes", 2, "two outputs in surfaces of 49,152 and 98,304 bytes",
              _mixed_outputs, expect_ops(("mul", "add"), lambda p: "error" if p.uniform_output_sizes else "ok"),
              ("mul", "add")),
        Probe("io.packed_read", 2, "a 49,152-byte tensor in 98,304-byte surfaces, padding full of garbage",
              _sized(X, 98304, 98304, 31), expect_ops(("add",)), ("add",)),
    ]
    for n in LADDER:
        shape = (1, 64, 1, n // 128)  # fp16: 128 bytes per spatial column of 64 channels
        probes.append(Probe(f"io.min_surface.{n}", 2, f"surfaces of exactly {n} bytes ({list(shape)} fp16)",
                            _sized(shape, n, n, 40 + n % 97),
                            expect_ops(("add",), lambda p, n=n: "ok" if n >= p.min_surface_bytes else "error"),
                            ("add",)))
    for w in WIDTHS:
        probes.append(Probe(f"io.spatial.{w}", 2, f"last dim {w} (the spatial multiple-of-16 claim)",
                            _sized((1, 64, 1, w), None, None, w),
                            expect_ops(("add",), lambda p, w=w: "ok" if w % p.spatial_multiple_of == 0 else "rejected"),
                            ("add",)))
    return probes
