"""The accumulator probes (the accumulator limit of 32768, docs/chip-profiles.md): the emulator
passes them under each accumulator, and `derive_profile` reads `accumulator_limit` and
`accumulator` back for `--write-profile`."""

from __future__ import annotations

import pytest

from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.doctor import derive_profile, run_suite
from anelm.doctor.harness import Observation
from anelm.doctor.probes_accum import accumulator_probes, first_limited_rung

NB = dict(compile_budget=10**9)
PROFILES = [STRICT.replace(name="strict-nb", **NB),
            STRICT.replace(name="q15.16", accumulator="q15.16", **NB),
            STRICT.replace(name="q15.16-unlimited", accumulator="q15.16", accumulator_limit=None, **NB),
            STRICT.replace(name="fp32-unlimited", accumulator_limit=None, **NB),
            STRICT.replace(name="fp32-40000", accumulator_limit=40000, **NB)]


def accumulator_fields(p):
    return p.accumulator_limit, p.accumulator


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_emulator_passes_the_probes_and_derive_reads_the_accumulator_back(profile):
    probes = accumulator_probes()
    obs = run_suite(Emulator(profile), probes)
    assert {p.name: obs[p.name].outcome for p in probes} == {p.name: p.expect(profile) for p in probes}
    derived = derive_profile(obs)
    want = (49152 if profile.accumulator_limit == 40000 else profile.accumulator_limit, profile.accumulator)
    assert accumulator_fields(derived) == want  # a limit between rungs reads as the next rung up
    assert {"accumulator_limit", "accumulator"} <= set(derived.notes["measured"])


def test_strict_readings_are_the_measured_facts():
    obs = run_suite(Emulator(PROFILES[0]), accumulator_probes())
    assert obs["acc.limit.conv"].detail == "32752 passes, 32768 is inf"
    assert obs["acc.limit.matmul"].outcome == "32768"  # 16384 + 16384, each product finite
    assert (obs["acc.precision.cancel"].outcome, obs["acc.precision.tiny"].outcome) == ("cancels", "kept")
    q = run_suite(Emulator(PROFILES[1]), accumulator_probes())
    assert "truncated to 1 LSB" in q["acc.precision.tiny"].detail


def _obs(**outcomes):
    return {k.replace("_", "."): Observation(k.replace("_", "."), "ok", v) for k, v in outcomes.items()}


def test_derive_records_the_lower_limit_and_flags_disagreement():
    d = derive_profile(_obs(acc_limit_conv="32768", acc_limit_matmul="none"))
    assert d.accumulator_limit == 32768 and "acc.limit" in d.notes["anomalies"]
    assert "accumulator" in d.notes["unmeasured"]


def test_contradicting_precision_readings_settle_nothing():
    d = derive_profile(_obs(acc_limit_conv="32768", acc_precision_tiny="dropped", acc_precision_cancel="cancels"),
                       base=STRICT.replace(accumulator="fp32"))
    assert d.accumulator == "fp32" and "accumulator" in d.notes["unmeasured"]
    assert "acc.precision" in d.notes["anomalies"]
    # with no limit, a partial sum cannot stick: dropped tiny products alone mean q15.16
    d = derive_profile(_obs(acc_limit_conv="none", acc_precision_tiny="dropped", acc_precision_cancel="cancels"))
    assert accumulator_fields(d) == (None, "q15.16")


def test_first_limited_rung():
    assert [first_limited_rung(v) for v in (None, 16384, 32768, 32769, 70000)] == \
        ["none", "16384", "32768", "49152", "none"]
