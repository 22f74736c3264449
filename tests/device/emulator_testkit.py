"""Helpers for the emulator tests: write tiny MIL programs, run them through an Emulator.

Imported by basename (pytest puts the test file's folder on sys.path).
"""

from __future__ import annotations

import numpy as np

from anelm.device.base import Surface
from anelm.device.emulator import Emulator, read_packed
from anelm.chip.profile import STRICT, ChipProfile
from anelm.doctor.milgen import program as mil  # noqa: F401 - MIL text written by hand, as the probes do
from anelm.doctor.milgen import ttype  # noqa: F401
from anelm.mil.program import storage_dtype

# Every strict behaviour off and fp32 compute: a program runs as its MIL spec says.
LOOSE = STRICT.replace(
    name="loose", rejected_ops=[], reject_conv_bias=False, reject_dynamic_conv_weight=False,
    reject_inline_matmul_transpose=False, min_surface_bytes=0, sdpa_ignores_mask=False,
    cast_only_at_boundary=False, compute_dtype="fp32", compile_budget=10**9, spatial_multiple_of=1)
# Strict behaviour, but no compile budget (for tests that compile many programs) and any I/O
# width (the op tests use small odd shapes; the width rule has tests of its own).
STRICT_NB = STRICT.replace(compile_budget=10**9, spatial_multiple_of=1)


def lit(v) -> str:
    """A MIL scalar or int/bool list literal in the program(1.3) dialect."""
    if isinstance(v, bool):
        return f"bool({str(v).lower()})"
    if isinstance(v, int):
        return f"int32({v})"
    if isinstance(v, float):
        return f"fp16({float(v)!r})"
    if isinstance(v, str):
        return f'string("{v}")'
    v = list(v)
    dt = "bool" if all(isinstance(x, bool) for x in v) else "int32"
    body = ", ".join(str(x).lower() if isinstance(x, bool) else str(x) for x in v)
    return f"tensor<{dt}, [{len(v)}]>([{body}])"


def const(name: str, v) -> str:
    """`<type> name = const()[name = string("name"), val = <lit>];`"""
    text = lit(v)
    typ = text.split("(")[0] if not text.startswith("tensor") else text.split(">(")[0] + ">"
    return f'{typ} {name} = const()[name = string("{name}"), val = {text}];'


def run(text: str, inputs: dict[str, np.ndarray], weights: dict[str, bytes] | None = None,
        profile: ChipProfile = STRICT_NB, order: list[str] | None = None) -> dict[str, np.ndarray]:
    """Compile, load and evaluate once with minimum-size surfaces in the profile's binding order."""
    dev = Emulator(profile)
    try:
        model = dev.compile(text, weights or {})
        dev.load(model)
        ins = [_surface(profile, [t for _, t in model.inputs]) for _ in model.inputs]
        outs = [_surface(profile, [t for _, t in model.outputs]) for _ in model.outputs]
        for (name, t), s in zip(model.inputs, ins):
            s.write(np.ascontiguousarray(inputs[name], dtype=storage_dtype(t.dtype)))
        dev.evaluate(model, ins, outs)
        return {name: read_packed(s, t).copy() for (name, t), s in zip(model.outputs, outs)}
    finally:
        dev.close()


def _surface(profile: ChipProfile, types) -> Surface:
    return Surface(max([profile.min_surface_bytes] + [t.nbytes for t in types]))

