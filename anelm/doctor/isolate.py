"""Run probes in a child process: the hardware suite and the compile-budget probe.

A private call with a wrong assumption can crash the process, and the budget probe spends
the process's compiles on purpose, so neither runs in the doctor itself. The child is
`python -m anelm.doctor` (see `child_main`), run through `anelm.device.isolate`: a JSON request
on stdin, one JSON line per event on stdout, so a crash or a wedge costs the probe in flight
only (reported as `crash` with the exit signal or the timeout) and every earlier observation
is kept. A fresh child then runs the probes after it, so one crash hides no other probe.
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
    caps the compile-budget probe's compiles. A child that dies in a probe is replaced by one
    that skips the probes already observed; one that dies in none (while starting, or in the
    self-test) or a second wedge in a row (a wedged aned stays so, costing `timeout` each) ends it.
    """
    request = {"kind": kind, "profile": json.loads(profile.to_json()), "probes": list(probe_names),
               "self_test": self_test, "uncapped": uncapped, "budget_limit": budget_limit}
    out, wedged = Isolated(), False
    while True:
        res = child.run_child({**request, "skip": sorted(out.observations)}, timeout, child_argv(),
                              observation=Observation.from_dict,
                              crashed=lambda probe, detail: Observation(probe, "crash", detail=detail))
        if request["self_test"]:
            out.self_test, request["self_test"] = res.self_test, False
        new = set(res.observations) - set(out.observations)
        out.observations.update(res.observations)
        out.error, out.wedged = res.error, res.wedged
        if res.error is None or not new or (wedged and res.wedged):
            return out
        wedged = res.wedged


def child_argv() -> list[str]:
    """The child's command line."""
    return [sys.executable, "-m", "anelm.doctor"]


def _run_probes(device, req: dict) -> None:
    skip = set(req.get("skip", ()))  # observed by an earlier child, which then died
    for probe in select(req["probes"], budget_limit=req.get("budget_limit", BUDGET_LIMIT)) if req["probes"] else []:
        if probe.name in skip:
            continue
        child.say("start", probe=probe.name)
        child.say("obs", obs=run_probe(probe, device).to_dict())


def child_main() -> int:
    """The child: read the request, run, report each step as it finishes."""
    return child.child_main(_run_probes)
