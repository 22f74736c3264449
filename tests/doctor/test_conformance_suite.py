"""The conformance suite, end to end against the emulator (the hardware column stays empty here).

The emulator must give, for every probe, the outcome its profile predicts; the probes must
flip when the profile flips (so a probe can fail); and `derive_profile` must read each
profile back from the observations it produced.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT, ChipProfile
from anelm.doctor import BUDGET_PROBE, all_probes, derive_profile, format_table, rel_err, rows, run_isolated, run_suite
from anelm.doctor import isolate
from anelm.doctor.harness import Observation
from anelm.doctor.suite import select
from anelm.errors import UsageError

UNCAPPED = dict(compile_budget=10**9)  # these tests compile the whole suite per profile
# every strict behaviour off: each compile-reject probe must now run and match numpy
LOOSE = STRICT.replace(name="loose", rejected_ops=[], reject_conv_bias=False, reject_dynamic_conv_weight=False,
                       reject_inline_matmul_transpose=False, bind_inputs_alphabetically=False,
                       bind_outputs_alphabetically=False, uniform_input_sizes=False, uniform_output_sizes=False,
                       min_surface_bytes=2048, sdpa_ignores_mask=False, reload_reads_new_weights=True,
                       cast_only_at_boundary=False, **UNCAPPED)
# the peer-reported switches on
PEER = STRICT.replace(name="peer", single_input_only=True, reject_reduce_mean=True, reject_rsqrt=True,
                      single_chunk_blobs_only=True, spatial_multiple_of=16, saturate_above=4094.0,
                      min_surface_bytes=16384, rejected_ops=["concat", "exp", "gelu"], **UNCAPPED)


def switches(p: ChipProfile, skip=("name", "notes", "compile_budget")) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in skip}
    d["rejected_ops"] = tuple(sorted(d["rejected_ops"]))
    return d


def mismatches(profile: ChipProfile, observations: dict) -> list[str]:
    return [f"{p.name}: got {observations[p.name].outcome} ({observations[p.name].detail}), "
            f"expected {p.expect(profile)}" for p in all_probes() if observations[p.name].outcome != p.expect(profile)]


@pytest.fixture(scope="module")
def strict_run():
    from anelm.device import base

    base.reset_compile_count()  # as a fresh `anelm doctor` process would start
    try:
        return run_suite(Emulator(STRICT), all_probes())
    finally:
        base.reset_compile_count()


def test_emulator_agrees_with_every_reference_under_strict(strict_run):
    assert mismatches(STRICT, strict_run) == []
    graded = [o for o in strict_run.values() if o.err is not None]
    assert len(graded) >= 40 and all(o.err <= o.tol for o in graded if o.status == "ok")


def test_derived_profile_equals_strict(strict_run):
    derived = derive_profile(strict_run)
    assert switches(derived) == switches(STRICT)
    assert derived.notes["unmeasured"] == ["compile_budget"]  # measured only in a child process


@pytest.mark.parametrize("profile", [LOOSE, PEER], ids=lambda p: p.name)
def test_probes_flip_with_the_profile_and_derive_reads_it_back(profile, fresh_compile_count):
    observations = run_suite(Emulator(profile), all_probes())
    assert mismatches(profile, observations) == []
    assert switches(derive_profile(observations)) == switches(profile)


def test_compile_rejects_fire_for_the_intended_reason(strict_run):
    # a typo in a probe's MIL would also read "rejected": the message must name the rule
    reasons = {"op.concat": "concat", "op.gelu": "gelu", "compile.conv_bias": "bias",
               "compile.conv_dynamic_weight": "weight", "compile.matmul_inline_transpose": "inline",
               "compile.cast_inside": "cast", "compile.undefined_return": "defined by no statement"}
    for probe, word in reasons.items():
        assert strict_run[probe].status == "rejected" and word in strict_run[probe].detail, probe


@pytest.mark.parametrize("profile", [STRICT, LOOSE, PEER, STRICT.replace(spatial_multiple_of=8, compile_budget=7),
                                     STRICT.replace(compute_dtype="fp32", single_input_only=False),
                                     STRICT.replace(quantize_rounding="half_away")],
                         ids=["strict", "loose", "peer", "spatial8", "fp32", "half_away"])
def test_derive_inverts_every_prediction(profile):
    probes = all_probes(budget=True, budget_limit=profile.compile_budget)  # a limit the profile's budget reaches
    predicted = {p.name: Observation(p.name, *_as_status(p.expect(profile))) for p in probes}
    assert switches(derive_profile(predicted), skip=("name", "notes")) == switches(profile, skip=("name", "notes"))


def _as_status(outcome: str) -> tuple[str, str | None]:
    plain = ("ok", "rejected", "wrong-result", "error", "crash", "skipped")
    return (outcome, None) if outcome in plain else ("ok", outcome)


def test_unmeasured_switches_keep_the_base_and_oddities_are_noted():
    obs = {"bind.inputs": Observation("bind.inputs", "crash", detail="boom"),
           "compile.undefined_return": Observation("compile.undefined_return", "ok")}
    derived = derive_profile(obs, base=PEER)
    assert switches(derived) == switches(PEER)
    assert "bind_inputs_alphabetically" in derived.notes["unmeasured"]
    assert set(derived.notes["anomalies"]) == {"bind.inputs", "compile.undefined_return"}


def test_budget_probe_counts_compiles_in_a_child_process():
    res = run_isolated("emulator", STRICT.replace(compile_budget=7), [BUDGET_PROBE])
    assert res.error is None
    obs = res.observations[BUDGET_PROBE]
    assert obs.outcome == "7" and "compile 8 failed" in obs.detail
    assert derive_profile(res.observations).compile_budget == 7


def test_child_process_runs_probes_and_survives_a_wedge():
    res = run_isolated("emulator", STRICT, ["op.add", "bind.outputs"])
    assert res.error is None and {k: o.outcome for k, o in res.observations.items()} == \
        {"op.add": "ok", "bind.outputs": "alphabetical"}
    res = run_isolated("emulator", STRICT, ["op.add"], timeout=0.001)  # no answer in time: killed, reported
    assert res.error and "no answer" in res.error


# The doctor's child with extra probes after op.add, each of which kills its process on purpose
BAD_PROBES = """
import ctypes, sys, time
from anelm.doctor import isolate, suite
from anelm.doctor.harness import Probe

def crash(h):
    ctypes.string_at(0)  # SIGSEGV, as a private call with a wrong assumption gives

def wedge(h):
    time.sleep(120)

bad = [Probe(name, 1, "kills its process on purpose", run, lambda prof: "ok") for name, run in {probes}]
real = suite.all_probes
suite.all_probes = lambda *a, **k: real(*a, **k)[:1] + bad + real(*a, **k)[1:]
sys.exit(isolate.child_main())
"""


def child_with(monkeypatch, probes: str) -> None:
    monkeypatch.setattr(isolate, "child_argv", lambda: [sys.executable, "-c", BAD_PROBES.format(probes=probes)])


def test_a_probe_that_crashes_its_child_hides_no_later_one(monkeypatch):
    child_with(monkeypatch, '[("op.crash", crash), ("op.crash_again", crash)]')
    res = run_isolated("emulator", STRICT, ["op.add", "op.crash", "op.crash_again", "op.sub", "bind.outputs"])
    assert res.error is None and {k: o.outcome for k, o in res.observations.items()} == {
        "op.add": "ok", "op.crash": "crash", "op.crash_again": "crash", "op.sub": "ok", "bind.outputs": "alphabetical"}
    assert "SIGSEGV" in res.observations["op.crash"].detail and "SIGSEGV" in res.observations["op.crash_again"].detail


@pytest.mark.slow
def test_a_second_wedge_in_a_row_ends_the_suite(monkeypatch):
    child_with(monkeypatch, '[("op.wedge", wedge), ("op.wedge_again", wedge)]')
    res = run_isolated("emulator", STRICT, ["op.add", "op.wedge", "op.wedge_again", "op.sub"], timeout=5)
    assert {k: o.outcome for k, o in res.observations.items()} == {"op.add": "ok", "op.wedge": "crash",
                                                                   "op.wedge_again": "crash"}
    assert res.wedged and "no answer for 5 s during op.wedge_again" in res.error  # op.sub: not run


def test_hardware_child_off_a_mac_reports_why():
    from anelm.device.ane import available

    if available()[0]:
        pytest.skip("this machine has an ANE")
    res = run_isolated("ane", STRICT, ["op.add"], self_test=True)
    assert res.observations == {} and "unavailable" in res.error


def test_budget_probe_is_refused_in_process():
    with pytest.raises(ValueError, match="child"):
        run_suite(Emulator(STRICT), select([BUDGET_PROBE]))


def test_select_by_prefix():
    assert [p.name for p in select(["bind."])] == ["bind.inputs", "bind.outputs"]
    assert len(select(None)) == len(all_probes()) and BUDGET_PROBE not in {p.name for p in select(None)}
    with pytest.raises(UsageError):
        select(["no-such-probe"])


def test_relative_error():
    ref = np.array([1.0, -2.0, np.inf])
    assert rel_err(ref, ref) == 0.0
    assert rel_err(np.array([1.0, -2.0, np.nan]), ref) == float("inf")
    assert rel_err(np.array([1.0, -1.9, np.inf]), ref) == pytest.approx(0.05)
    assert rel_err(np.zeros(2), np.zeros(3)) == float("inf")


def test_table_marks_disagreements(strict_run, fresh_compile_count):
    loose = run_suite(Emulator(LOOSE), select(["op.concat", "op.add"]))
    table = rows(select(["op.concat", "op.add"]), loose, strict_run, STRICT)  # two columns that differ
    assert [(r.probe, r.agree) for r in table] == [("op.add", True), ("op.concat", False)]
    text = format_table(table, "strict")
    assert "op.concat" in text and "NO" in text.splitlines()[-1] and "yes" in text.splitlines()[-2]
