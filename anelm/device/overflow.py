"""fp16 overflow diagnostics: the first op whose result overflowed, once per kernel
(docs/chip-profiles.md).

A device's `evaluate(..., watch=True)` returns an `Overflow` when a result came out inf or NaN
from finite operands: the emulator names the first such op in execution order (it sees every
op result as it rounds it); the ANE backend sees only what it reads back, so it names the
output (`op` is "output"). `runtime.Kernel` watches until its kernel has warned and prints

    anelm: warning: fp16 overflow in kernel <kernel>, <op> '<node>'

to stderr once per kernel name and process run. The line is written here, directly, rather
than through `warnings.warn`: Python's warning filters would show it once per call site, not
per kernel, and a filter set by a caller could hide it.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np

_lock = threading.Lock()
_warned: set[str] = set()  # kernel names that have warned in this process


@dataclass(frozen=True)
class Overflow:
    op: str  # the MIL op, or "output" where only the outputs are seen
    node: str  # its node name (the output's name)


class FirstOverflow:
    """Finds the first op that made a non-finite result from finite operands. The rounding's
    count says when a result is not finite; only then are the op's operands looked at, and each
    value found non-finite is remembered, so an inf that spreads is scanned for once."""

    def __init__(self):
        self.found: Overflow | None = None
        self.nonfinite: set[str] = set()

    def step(self, st, res, env: dict) -> None:
        origin = None
        for (name, _), chk, r in zip(st.outs, st.checked, res):
            env[name], finite = chk(r)
            if not finite:
                self.nonfinite.add(name)
                origin = origin if origin is not None else self.operands_finite(st, env)
        if origin:
            self.found = Overflow(st.op, st.node)

    def operands_finite(self, st, env: dict) -> bool:
        for key in st.keys():
            v = env[key]
            if key in self.nonfinite:
                return False
            if isinstance(v, np.ndarray) and v.dtype.kind == "f" and not np.isfinite(v).all():
                self.nonfinite.add(key)
                return False
        return True


def warned(kernel: str) -> bool:
    return kernel in _warned


def warn_overflow(kernel: str, where: Overflow) -> bool:
    """Print the overflow warning for `kernel` unless it has been printed already; True when printed."""
    with _lock:
        if kernel in _warned:
            return False
        _warned.add(kernel)
    print(f"anelm: warning: fp16 overflow in kernel {kernel}, {where.op} '{where.node}'", file=sys.stderr, flush=True)
    return True


def reset_overflow_warnings() -> None:
    """For tests: as a fresh process starts, no kernel has warned."""
    with _lock:
        _warned.clear()


def output_overflow(model, profile, inputs: list, outputs: list) -> Overflow | None:
    """For a device that sees only its surfaces (the ANE): the first output, in binding order,
    holding inf or NaN while every float input was finite. `model.mil_text` gives the names and
    dtypes, parsed once per model."""
    io = getattr(model, "io_types", None)
    if io is None:
        io = model.io_types = _io_types(model.mil_text, profile)
    ins, outs = io
    bad = next((name for (name, t), s in zip(outs, outputs) if _nonfinite(s, t)), None)
    if bad is None or any(_nonfinite(s, t) for (_, t), s in zip(ins, inputs)):
        return None
    return Overflow("output", bad)


def _io_types(mil_text: str, profile) -> tuple[list, list]:
    from ..chip.surfaces import bind_order  # noqa: PLC0415
    from ..mil.parser import parse  # noqa: PLC0415 - lark loads on first use

    func = parse(mil_text).main
    types = func.result_types()
    ins = bind_order([n for _, n in func.inputs], profile, "inputs")
    outs = bind_order(list(func.outputs), profile, "outputs")
    return [(n, types[n]) for n in ins], [(n, types[n]) for n in outs]


def _nonfinite(surface, t) -> bool:
    import numpy as np  # noqa: PLC0415

    if t.dtype not in ("fp16", "fp32"):
        return False
    values = surface.read(t.nbytes).view(np.float16 if t.dtype == "fp16" else np.float32)
    return not np.isfinite(values).all()
