"""Run probes in a child process: the hardware suite and the compile-budget probe.

A private call with a wrong assumption can crash the process, and the budget probe spends
the process's compiles on purpose, so neither runs in the doctor itself. The child is
`python -m anelm.doctor` (see `child_main`), given a JSON request on stdin; it answers with one JSON
line per event on stdout, so a crash or a wedge costs the probe in flight only (reported as
`crash` with the exit signal or the timeout) and every earlier observation is kept.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..chip.profile import ChipProfile
from .harness import Observation, run_probe
from .suite import BUDGET_LIMIT, select

UNCAPPED = 10**9  # on hardware our own budget counter must not stop what the chip is asked
MARK = "@@anelm-doctor "  # our lines on stdout; anything else the frameworks print is ignored


@dataclass
class Isolated:
    observations: dict[str, Observation] = field(default_factory=dict)
    self_test: str | None = None  # None: not run; "": passed; else the failure
    error: str | None = None  # the child died, timed out or could not start


def run_isolated(kind: str, profile: ChipProfile, probe_names: list[str], *, self_test: bool = False,
                 uncapped: bool = False, timeout: float = 120.0, budget_limit: int = BUDGET_LIMIT) -> Isolated:
    """Run the named probes on a fresh `kind` device ("ane" or "emulator") in a child process.

    `timeout` bounds the wait for each event (one probe, or the self-test); `budget_limit`
    caps the compile-budget probe's compiles.
    """
    request = {"kind": kind, "profile": json.loads(profile.to_json()), "probes": list(probe_names),
               "self_test": self_test, "uncapped": uncapped, "budget_limit": budget_limit}
    result, current = Isolated(), None
    with tempfile.TemporaryFile("w+") as err:  # a file, so a chatty child can never block on stderr
        proc = subprocess.Popen(child_argv(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the child died before reading: its exit status says how
        try:
            current = _collect(lines, result, timeout)
        finally:
            if result.error and proc.poll() is None:
                proc.kill()  # our own child, by its handle: it wedged
            proc.wait(30)
        err.seek(0)
        tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:]
    if result.error is None and proc.returncode != 0:
        result.error = f"the child process died: {_exit(proc.returncode)}" + (f"; last words: {tail[0]}" if tail else "")
    if current is not None and current not in result.observations:
        result.observations[current] = Observation(current, "crash", detail=result.error or "the child process died")
    return result


def child_argv() -> list[str]:
    """The child's command line (tests point it at a child that crashes)."""
    return [sys.executable, "-m", "anelm.doctor"]


def _child_env() -> dict:
    # the child imports the same anelm as this process, installed or not
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        if line.startswith(MARK):
            lines.put(json.loads(line[len(MARK):]))
    lines.put(None)


def _collect(lines: queue.Queue, result: Isolated, timeout: float) -> str | None:
    """Read events until done; returns the probe in flight if the child stopped mid-probe."""
    current = None
    while True:
        try:
            event = lines.get(timeout=timeout)
        except queue.Empty:
            result.error = f"no answer for {timeout:.0f} s" + (f" during {current}" if current else "")
            return current
        if event is None or event["event"] == "done":
            return current
        if event["event"] == "start":
            current = event["probe"]
        elif event["event"] == "obs":
            obs = Observation.from_dict(event["obs"])
            result.observations[obs.probe], current = obs, None
        elif event["event"] == "self_test":
            result.self_test = event["error"]
        elif event["event"] == "fatal":
            result.error = event["error"]


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def make_device(kind: str, profile: ChipProfile, uncapped: bool = False):
    if uncapped:
        profile = profile.replace(compile_budget=UNCAPPED)
    if kind == "ane":
        from ..device.ane import AneDevice  # noqa: PLC0415 - binds the private framework

        return AneDevice(profile)
    if kind == "emulator":
        from ..device.emulator import Emulator  # noqa: PLC0415

        return Emulator(profile)
    raise ValueError(f"device kind {kind!r}: expected 'ane' or 'emulator'")


def _say(event: str, **payload) -> None:
    print(MARK + json.dumps({"event": event, **payload}), flush=True)


def child_main() -> int:
    """The child: read the request, run, report each step as it finishes."""
    try:
        req = json.loads(sys.stdin.read())
        device = make_device(req["kind"], ChipProfile.from_dict(req["profile"]), req["uncapped"])
        if req["self_test"]:
            try:
                device.self_test()
                _say("self_test", error="")
            except Exception as e:  # noqa: BLE001 - reported; the probes still run, to show what breaks
                _say("self_test", error=f"{type(e).__name__}: {e}".splitlines()[0])
        for probe in select(req["probes"], budget_limit=req.get("budget_limit", BUDGET_LIMIT)) if req["probes"] else []:
            _say("start", probe=probe.name)
            _say("obs", obs=run_probe(probe, device).to_dict())
        device.close()
        _say("done")
        return 0
    except Exception as e:  # noqa: BLE001 - anything here is the child's last word
        _say("fatal", error=f"{type(e).__name__}: {e}".splitlines()[0])
        return 1
