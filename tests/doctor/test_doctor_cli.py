"""`anelm doctor` through the real entry point, `anelm.cli.main.main`."""

from __future__ import annotations

import json

import pytest

from anelm.cli.main import main
from anelm.device.ane import available
from anelm.chip.profile import STRICT, load_profile

HAS_ANE = available()[0]
linux_only = pytest.mark.skipif(HAS_ANE, reason="checks the report of a machine without an ANE")


@linux_only
def test_doctor_reports_no_ane_and_runs_the_suite_on_the_emulator(capsys, fresh_compile_count):
    assert main(["doctor"]) == 0
    out, err = capsys.readouterr()
    assert "ANE       not available: not macOS" in out or "not Apple Silicon" in out
    assert "backend   emulator (no Apple Neural Engine" in out
    assert "hardware column empty" in out
    assert "emulator matches the 'strict' profile on" in out and "unexpected" not in out
    assert err.startswith("anelm: device: emulator (no Apple Neural Engine")


def test_doctor_json_is_one_document(capsys, fresh_compile_count):
    assert main(["doctor", "--json", "--probe", "op.add", "--probe", "bind."]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["probe"] for p in report["probes"]] == ["op.add", "bind.inputs", "bind.outputs"]
    assert {p["emulator"]["outcome"] for p in report["probes"]} == {"ok", "alphabetical"}
    assert set(report) >= {"machine", "ane", "backend", "profile", "summary"}
    if not HAS_ANE:
        assert report["backend"]["name"] == "emulator" and all(p["hardware"] is None for p in report["probes"])


def test_doctor_writes_a_profile_the_emulator_loads(tmp_path, capsys, fresh_compile_count):
    path = tmp_path / "observed.json"
    assert main(["doctor", "--device=emulator", "--write-profile", str(path)]) == 0
    loaded = load_profile(str(path))
    for field in ("rejected_ops", "min_surface_bytes", "sdpa_ignores_mask", "bind_inputs_alphabetically"):
        assert getattr(loaded, field) == getattr(STRICT, field)
    assert loaded.notes["source"] == "emulator" and "compile_budget" in loaded.notes["unmeasured"]
    assert "derived from the emulator" in capsys.readouterr().err


def test_doctor_without_the_suite(capsys):
    assert main(["doctor", "--no-conformance", "--device", "emulator"]) == 0
    out = capsys.readouterr().out
    assert "machine" in out and "conformance suite" not in out


@linux_only
def test_doctor_device_ane_without_an_ane_is_a_one_line_error(capsys):
    assert main(["doctor", "--device", "ane"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anelm: error: --device ane requested")


def test_doctor_unknown_probe_is_a_usage_error(capsys):
    assert main(["doctor", "--probe", "nope"]) == 2
    assert "anelm: error:" in capsys.readouterr().err
