"""`anelm doctor`: the machine, the backend chosen and why, and the hardware conformance suite.

    anelm doctor                                  # report + suite on every available device
    anelm doctor --write-profile m4.json          # save the behaviour the chip showed
    anelm doctor --probe bind. --probe sem.       # a subset, by name or prefix
    anelm doctor --budget 130 --write-profile m4.json   # does this chip take 130 cold compiles?

On Apple Silicon the suite runs on the ANE (in a child process: a crash costs one probe) and
on the emulator, side by side. Elsewhere the hardware column is empty and the emulator is
checked against the profile's own predictions. The report goes to stdout (`--json`: one JSON
document); the device notice goes to stderr. Exit 0 whenever the report was produced.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..chip.profile import ChipProfile, load_profile
from ..device import machine
from ..device.ane import selftest
from ..device.isolate import make_device
from ..errors import DeviceError, UsageError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "ane", "emulator"), default="auto",
                   help="auto: hardware column when the ANE works; ane: require it; emulator: skip hardware")
    p.add_argument("--profile", default=None, help="chip profile the emulator follows (path or 'strict'; "
                   "default ANELM_PROFILE or strict)")
    p.add_argument("--conformance", action=argparse.BooleanOptionalAction, default=True,
                   help="run the conformance suite (default: on; about 2 s on the emulator)")
    p.add_argument("--probe", action="append", metavar="NAME", help="only probes with this name or prefix (repeatable)")
    p.add_argument("--budget", type=int, metavar="N", default=None,
                   help="also try N cold compiles in one process (a child per device), each run and checked; "
                        "--write-profile then records the good ones as compile_budget (strict: 115)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one hardware probe")
    p.add_argument("--write-profile", metavar="PATH", help="write the chip profile derived from the observations")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")


def _ane_status() -> tuple[bool, str]:
    try:
        from ..device import ane  # noqa: PLC0415 - guarded: the backend is optional everywhere
    except Exception as e:  # noqa: BLE001 - a broken backend is a finding, not a crash
        return False, f"backend did not import: {type(e).__name__}: {e}"
    try:
        return ane.available()
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}".splitlines()[0]


def run(args: argparse.Namespace) -> int:
    from .. import doctor  # noqa: PLC0415 - the suite is only needed here

    if args.budget is not None and args.budget < 1:
        raise UsageError(f"--budget {args.budget}: expected a positive number of compiles")
    profile = load_profile(args.profile)
    facts = machine.collect()
    ane_ok, ane_why = _ane_status()
    if args.device == "ane" and not ane_ok:
        raise DeviceError(f"--device ane requested but the Apple Neural Engine is unavailable: {ane_why}")
    probes = doctor.select(args.probe) if args.conformance else []
    names = [p.name for p in probes if p.name != doctor.BUDGET_PROBE]
    hw = None
    if ane_ok and args.device != "emulator":
        hw = doctor.run_isolated("ane", profile, names, self_test=True, uncapped=True, timeout=args.timeout)
        selftest.record(*selftest.judge(hw))  # what `--device auto` reads: the doctor's own measurement
    backend, why = _backend(args.device, ane_ok, ane_why, hw)
    print(f"anelm: device: {backend} ({why})", file=sys.stderr, flush=True)
    # uncapped: a small profile budget must not cut the suite short (`--budget` measures it apart)
    emu = doctor.run_suite(make_device("emulator", profile, uncapped=True),
                           [p for p in probes if p.name != doctor.BUDGET_PROBE])
    hw_obs = dict(hw.observations) if hw else None
    if args.budget is not None:
        probes = probes + [doctor.suite.budget_probe(args.budget)]
        if hw is not None:
            hw_obs.update(_budget("ane", profile, args.timeout, args.budget))
        emu.update(_budget("emulator", profile, args.timeout, args.budget))
    table = doctor.rows(probes, hw_obs, emu, profile)
    derived = None
    if args.write_profile:
        derived = _write_profile(args.write_profile, hw_obs or emu, profile, facts, hw_obs is not None)
    report = {"machine": facts.to_dict(), "ane": {"available": ane_ok, "reason": ane_why,
                                                  "self_test": hw.self_test if hw else None,
                                                  "suite_error": hw.error if hw else None},
              "backend": {"name": backend, "reason": why}, "profile": profile.name,
              "probes": [r.to_dict() for r in table], "summary": _summary(table),
              "unprobed_ops": doctor.unprobed_ops(probes) if probes else [],
              "derived_profile": json.loads(derived.to_json()) if derived else None}
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report, table, profile, facts)
    return 0


def _backend(device: str, ane_ok: bool, ane_why: str, hw) -> tuple[str, str]:
    if device == "emulator":
        return "emulator", "requested"
    if not ane_ok:
        return "emulator", f"no Apple Neural Engine: {ane_why}"
    if hw.self_test == "":
        return "ane", "the backend initialised and passed its self-test"
    if device == "ane":
        raise DeviceError(f"--device ane: the ANE self-test failed: {hw.self_test or hw.error}")
    return "emulator", f"the ANE self-test failed: {hw.self_test or hw.error}"


def _budget(kind: str, profile: ChipProfile, timeout: float, limit: int) -> dict:
    from ..doctor import BUDGET_PROBE, run_isolated  # noqa: PLC0415

    # hardware: lift our own counter so the chip's limit (or N) is what stops the loop
    res = run_isolated(kind, profile, [BUDGET_PROBE], uncapped=(kind == "ane"), timeout=max(timeout, 600.0),
                       budget_limit=limit)
    return res.observations


def _write_profile(path: str, observations: dict, base: ChipProfile, facts, from_hardware: bool) -> ChipProfile:
    from ..doctor import derive_profile  # noqa: PLC0415

    if not from_hardware:
        print("anelm: warning: no hardware observations; the profile is derived from the emulator and "
              f"restates '{base.name}'", file=sys.stderr)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{facts.chip or 'emulator'} macos {facts.os_version}".lower()).strip("-")
    notes = {"source": "hardware" if from_hardware else "emulator", "chip": facts.chip, "ane_arch": facts.ane_arch,
             "os": facts.os, "os_version": facts.os_version, "base_profile": base.name}
    derived = derive_profile(observations, base=base, name=slug if from_hardware else f"{base.name}-restated",
                             notes=notes)
    derived.save(path)
    print(f"anelm: wrote chip profile '{derived.name}' to {path}", file=sys.stderr)
    return derived


def _summary(table) -> dict:
    with_hw = [r for r in table if r.hardware is not None]
    return {"probes": len(table), "hardware_run": len(with_hw),
            "agree": sum(1 for r in with_hw if r.agree), "disagree": [r.probe for r in with_hw if r.agree is False],
            "emulator_as_expected": sum(1 for r in table if r.emulator_as_expected),
            "emulator_unexpected": [r.probe for r in table if r.emulator_as_expected is False]}


def _print_report(report: dict, table, profile: ChipProfile, facts) -> None:
    from ..doctor import format_table  # noqa: PLC0415

    ane = report["ane"]
    print(f"machine   {facts.describe()}")
    print(f"ANE       {'present' if ane['available'] else 'not available'}: {ane['reason']}")
    if ane["self_test"] is not None:
        print(f"self-test {'passed' if ane['self_test'] == '' else 'FAILED: ' + ane['self_test']}")
    print(f"backend   {report['backend']['name']} ({report['backend']['reason']})")
    print(f"profile   {profile.name}")
    if not table:
        return
    hw_note = "" if ane["available"] else "; hardware column empty: no ANE here"
    print(f"\nconformance suite: {len(table)} probes{hw_note}\n")
    print(format_table(table, profile.name))
    s = report["summary"]
    if s["hardware_run"]:
        print(f"\nhardware and emulator agree on {s['agree']}/{s['hardware_run']} probes"
              + (f"; differ on {', '.join(s['disagree'])}" if s["disagree"] else ""))
    if ane["suite_error"]:
        print(f"hardware suite stopped early: {ane['suite_error']}")
    print(f"emulator matches the '{profile.name}' profile on {s['emulator_as_expected']}/{s['probes']} probes"
          + (f"; unexpected (marked !): {', '.join(s['emulator_unexpected'])}" if s["emulator_unexpected"] else ""))
    if report["unprobed_ops"]:
        print(f"ops not probed: {', '.join(report['unprobed_ops'])}")
