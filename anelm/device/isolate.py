"""Run device work in a child process: the ANE self-test behind `--device auto`, and the
doctor's hardware probes and compile-budget probe (`anelm.doctor.isolate`).

A private call with a wrong assumption can crash the process, and the budget probe spends
the process's compiles on purpose, so neither runs in the caller. The child gets a JSON
request on stdin and answers with one JSON line per event on stdout, marked with MARK, so a
crash or a wedge costs the step in flight only (reported with the exit signal or the
timeout) and every earlier answer is kept.

Events: `start` {probe} and `obs` {obs} (the doctor's), `self_test` {error: "" when it
passed}, `fatal` {error}, `done`. The self-test's own child is `python -m anelm.device.isolate`.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..chip.profile import ChipProfile

UNCAPPED = 10**9  # on hardware our own budget counter must not stop what the chip is asked
MARK = "@@anelm-doctor "  # our lines on stdout; anything else the frameworks print is ignored
EXIT_WAIT_S = 30.0  # for a child to exit after its last answer; then it is killed


@dataclass
class Isolated:
    observations: dict[str, Any] = field(default_factory=dict)  # probe -> its observation
    self_test: str | None = None  # None: not run; "": passed; else the failure
    error: str | None = None  # the child died, timed out or could not start
    wedged: bool = False  # it stopped answering (timed out), rather than died


def child_argv() -> list[str]:
    """The self-test child's command line (tests point it at a child that crashes)."""
    return [sys.executable, "-m", "anelm.device.isolate"]


def run_child(request: dict, timeout: float, argv: list[str] | None = None,
              observation: Callable[[dict], Any] = dict,
              crashed: Callable[[str, str], Any] = lambda probe, detail: {"probe": probe, "detail": detail}
              ) -> Isolated:
    """Send `request` to a child (`argv`, else `child_argv()`) and collect its events.

    `timeout` bounds the wait for each event. `observation` turns an `obs` payload into
    the caller's record; `crashed(probe, detail)` makes the record of the probe in flight
    when the child died.
    """
    result, current = Isolated(), None
    with tempfile.TemporaryFile("w+") as err:  # a file, so a chatty child can never block on stderr
        proc = subprocess.Popen(argv or child_argv(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the child died before reading: its exit status says how
        hung = False
        try:
            current = _collect(lines, result, timeout, observation)
        finally:
            if result.error and proc.poll() is None:
                proc.kill()  # our own child, by its handle: it wedged
            try:
                proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:  # it answered, then hung at exit: its answers stand
                proc.kill()
                proc.wait()
                hung = True
        err.seek(0)
        tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:]
    if result.error is None and proc.returncode != 0 and not hung:
        result.error = f"the child process died: {_exit(proc.returncode)}" + (f"; last words: {tail[0]}" if tail else "")
    if current is not None and current not in result.observations:
        result.observations[current] = crashed(current, result.error or "the child process died")
    return result


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


def _collect(lines: queue.Queue, result: Isolated, timeout: float, observation) -> str | None:
    """Read events until done; returns the probe in flight if the child stopped mid-probe."""
    current = None
    while True:
        try:
            event = lines.get(timeout=timeout)
        except queue.Empty:
            result.error = f"no answer for {timeout:.0f} s" + (f" during {current}" if current else "")
            result.wedged = True
            return current
        if event is None or event["event"] == "done":
            return current
        if event["event"] == "start":
            current = event["probe"]
        elif event["event"] == "obs":
            obs = observation(event["obs"])
            result.observations[event["obs"]["probe"]], current = obs, None
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


# ------------------------------------------------------------------------------ the child

def make_device(kind: str, profile: ChipProfile, uncapped: bool = False):
    if uncapped:
        profile = profile.replace(compile_budget=UNCAPPED)
    if kind == "ane":
        from .ane import AneDevice  # noqa: PLC0415 - binds the private framework

        return AneDevice(profile)
    if kind == "emulator":
        from .emulator import Emulator  # noqa: PLC0415

        return Emulator(profile)
    raise ValueError(f"device kind {kind!r}: expected 'ane' or 'emulator'")


def say(event: str, **payload) -> None:
    print(MARK + json.dumps({"event": event, **payload}), flush=True)


def child_main(run_probes: Callable[[Any, dict], None] | None = None) -> int:
    """The child: read the request, make the device, run its self-test if asked, then
    `run_probes(device, request)` (the doctor's), reporting each step as it finishes."""
    try:
        req = json.loads(sys.stdin.read())
        device = make_device(req["kind"], ChipProfile.from_dict(req["profile"]), req.get("uncapped", False))
        if req.get("self_test"):
            try:
                device.self_test()
                say("self_test", error="")
            except Exception as e:  # noqa: BLE001 - reported; the probes still run, to show what breaks
                say("self_test", error=f"{type(e).__name__}: {e}".splitlines()[0])
        if run_probes is not None:
            run_probes(device, req)
        device.close()
        say("done")
        return 0
    except Exception as e:  # noqa: BLE001 - anything here is the child's last word
        say("fatal", error=f"{type(e).__name__}: {e}".splitlines()[0])
        return 1


if __name__ == "__main__":
    sys.exit(child_main())
