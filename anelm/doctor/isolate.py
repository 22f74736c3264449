"""Run probes in a child process: the hardware suite and the compile-budget probe.

A private call with a wrong assumption can crash the process, and the budget probe spends
the process's compiles on purpose, so neither runs in the doctor itself. The child is
`python -m anelm.doctor` (see `child_main`), run through `anelm.device.isolate`: a JSON request
on stdin, one JSON line per event on stdout, so a crash or a wedge costs the probe in flight
only (reported as `crash` with the exit signal or the timeout) and every earlier observation
is kept.
"""

from __future__ import annotations

import json
import sys

from ..chip.profile import ChipProfile
from ..device import isolate as child
from ..device.isolate import Isolated
from .harness import Observation, run_probe
from .suite import BUDGET_LIMIT, select


def run_isolated(kind: str, profile: ChipProfile, probe_names: list[str], *, self_test: bool = False,
                 uncapped: bool = False, timeout: float = 120.0, budget_limit: int = BUDGET_LIMIT) -> Isolated:
    """Run the named probes on a fresh `kind` device ("ane" or "emulator") in a child process.

    `timeout` bounds the wait for each event (one probe, or the self-test); `budget_limit`
    caps the compile-budget probe's compiles.
    """
    request = {"kind": kind, "profile": json.loads(profile.to_json()), "probes": list(probe_names),
               "self_test": self_test, "uncapped": uncapped, "budget_limit": budget_limit}
    return child.run_child(request, timeout, child_argv(), observation=Observation.from_dict,
                           crashed=lambda probe, detail: Observation(probe, "crash", detail=detail))


def child_argv() -> list[str]:
    """The child's command line."""
    return [sys.executable, "-m", "anelm.doctor"]


def _run_probes(device, req: dict) -> None:
    for probe in select(req["probes"], budget_limit=req.get("budget_limit", BUDGET_LIMIT)) if req["probes"] else []:
        child.say("start", probe=probe.name)
        child.say("obs", obs=run_probe(probe, device).to_dict())


def child_main() -> int:
    """The child: read the request, run, report each step as it finishes."""
    return child.child_main(_run_probes)
