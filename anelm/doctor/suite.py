"""The conformance suite: every probe, run on a device, laid out side by side.

    probes = all_probes()
    emu = run_suite(Emulator(profile), probes)           # {name: Observation}
    table = rows(probes, hardware=None, emulator=emu, profile=profile)
    print(format_table(table))

The hardware column comes from `isolate.run_isolated("ane", ...)`, in a child process, so a
wedged or crashing private call costs one probe, not the doctor.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..chip.profile import ChipProfile
from .harness import ELEMENTWISE, Harness, Observation, Probe, f64, rel_err, run_probe
from .milgen import const, op, program
from .probes_accum import accumulator_probes
from .probes_int8 import int8_probes
from .probes_io import io_probes
from .probes_kernels import kernel_probes
from .probes_ops import X, expect_ops, op_probes
from .probes_semantics import semantic_probes

BUDGET_PROBE = "budget.compiles"
BUDGET_LIMIT = 250  # past every reported failure point (maderix ~119, PR #23 up to 132)


def _budget_run(h: Harness, limit: int) -> Observation:
    """Cold-compile, run and check distinct programs until one fails; count the good ones.

    Each run's programs carry a fresh nonce, so neither aned's cache nor ours serves them
    (a served program is not a compile). Every result is checked: libane reports silent
    failures before the crash, so a compile that "succeeds" is not yet a good one.
    """
    from ..errors import AnelmError  # noqa: PLC0415

    dev, nonce = h.device, secrets.randbelow(2**31)
    x = np.linspace(-4, 4, int(np.prod(X))).astype(np.float16).reshape(X)
    inp, out = h.surface(x.nbytes, x), h.surface(x.nbytes)
    for n in range(limit):
        k = float(n % 64) / 8  # exact in fp16, and so is x + k
        text = program([("x", "fp16", X)], [const(f"k_{nonce}_{n}", "fp16", k),
                                            op("y", "fp16", X, "add", x="x", y=f"k_{nonce}_{n}")], ["y"])
        model = None
        try:
            model = dev.compile(text, {})
            dev.load(model)
            dev.evaluate(model, [inp], [out])
            got = out.read(x.nbytes).view(np.float16).reshape(X)
            dev.unload(model)
        except AnelmError as e:
            return Observation("", "ok", str(n), detail=f"compile {n + 1} failed: {str(e).splitlines()[0]}")
        finally:
            getattr(model, "release", lambda: None)()  # hardware handles own a folder: free it now
        if rel_err(got, f64(x) + k) > ELEMENTWISE:
            return Observation("", "ok", str(n), detail=f"compile {n + 1} ran but computed a wrong result")
    return Observation("", "ok", str(limit), detail=f"{limit} good compiles: the budget is at least that")


def budget_probe(limit: int = BUDGET_LIMIT) -> Probe:
    """`limit` cold compiles at most; a profile predicts min(limit, its compile_budget)."""
    return Probe(BUDGET_PROBE, 5, f"cold compiles per process until one fails, up to {limit} (a child process)",
                 lambda h: _budget_run(h, limit), expect_ops(("add",), lambda p: str(min(limit, p.compile_budget))),
                 ("add",))


def all_probes(budget: bool = False, budget_limit: int = BUDGET_LIMIT) -> list[Probe]:
    probes = op_probes() + io_probes() + semantic_probes() + accumulator_probes() + int8_probes() + kernel_probes()
    return probes + [budget_probe(budget_limit)] if budget else probes


def select(names: list[str] | None, budget: bool = False, budget_limit: int = BUDGET_LIMIT) -> list[Probe]:
    """Probes whose name equals or starts with one of `names` (all when None), in suite order."""
    probes = all_probes(budget or bool(names and any(BUDGET_PROBE.startswith(n) for n in names)), budget_limit)
    if not names:
        return probes
    picked = [p for p in probes if any(p.name == n or p.name.startswith(n) for n in names)]
    if not picked:
        from ..errors import UsageError  # noqa: PLC0415

        raise UsageError(f"--probe {' '.join(names)}: no such probe; expected a name or prefix such as "
                         "'op.', 'bind.', 'io.', 'sem.', 'acc.', 'int8.', 'kernel.'")
    return picked


def run_suite(device, probes: list[Probe] | None = None,
              progress: Callable[[Observation], None] | None = None) -> dict[str, Observation]:
    """Run every probe on `device` in this process (the budget probe is refused: it needs a child)."""
    out = {}
    for p in probes if probes is not None else all_probes():
        if p.name == BUDGET_PROBE:
            raise ValueError("the compile-budget probe spends this process's budget; run it in a child process "
                             "with isolate.run_isolated")
        out[p.name] = obs = run_probe(p, device)
        if progress:
            progress(obs)
    return out


def unprobed_ops(probes: list[Probe]) -> list[str]:
    """Ops of the emulator's table that no probe exercises (const is in every program)."""
    from ..ir.ops import OP_TABLE  # noqa: PLC0415

    covered = {o for p in probes for o in p.ops} | {"const"}
    return sorted(set(OP_TABLE) - covered)


@dataclass
class Row:
    probe: str
    grade: int
    what: str
    hardware: Observation | None
    emulator: Observation | None
    expected: str

    @property
    def agree(self) -> bool | None:
        """Hardware and emulator give the same outcome; None when a column is empty."""
        if self.hardware is None or self.emulator is None:
            return None
        return self.hardware.outcome == self.emulator.outcome

    @property
    def emulator_as_expected(self) -> bool | None:
        return None if self.emulator is None else self.emulator.outcome == self.expected

    def to_dict(self) -> dict:
        return {"probe": self.probe, "grade": self.grade, "what": self.what, "expected": self.expected,
                "hardware": self.hardware.to_dict() if self.hardware else None,
                "emulator": self.emulator.to_dict() if self.emulator else None,
                "agree": self.agree, "emulator_as_expected": self.emulator_as_expected}


def rows(probes: list[Probe], hardware: dict[str, Observation] | None, emulator: dict[str, Observation] | None,
         profile: ChipProfile) -> list[Row]:
    hw, emu = hardware or {}, emulator or {}
    return [Row(p.name, p.grade, p.what, hw.get(p.name), emu.get(p.name), p.expect(profile))
            for p in sorted(probes, key=lambda p: p.grade) if p.name in hw or p.name in emu]


def cell(obs: Observation | None) -> str:
    if obs is None:
        return "-"
    if obs.err is not None and obs.status in ("ok", "wrong-result"):
        return f"{obs.outcome} ({obs.err:.1e})"
    return obs.outcome


def format_table(table: list[Row], profile_name: str) -> str:
    head = ("probe", "hardware", "emulator", "agree?", f"{profile_name} expects")
    body = [(r.probe, cell(r.hardware), cell(r.emulator) + ("" if r.emulator_as_expected in (None, True) else " !"),
             {None: "", True: "yes", False: "NO"}[r.agree], r.expected) for r in table]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, body)])

