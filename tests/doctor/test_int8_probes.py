"""The int8 probes (doctor/probes_int8.py): they read the emulator's rounding switch back, the
profile derived from a half-away-from-zero device says so, and a device whose int8 sums are
limited like the fp16 accumulator is caught (so the accumulator probe can fail)."""

import numpy as np
import pytest

from anelm.device.emulator import int8 as emulator_int8
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT
from anelm.doctor import derive_profile, run_suite, select
from anelm.doctor.probes_int8 import ACCUM, ROUNDING, STEPS, quantize_reference


def test_reference_rounds_the_ties_each_way():
    # written out by hand: the ties of STEPS[:12], then the non-ties and the saturations
    even = [0, 2, 2, 4, 126, 127, -0, -2, -2, -126, -128, -128]
    away = [1, 2, 3, 4, 127, 127, -1, -2, -3, -127, -128, -128]
    rest = [0, 1, -1, 5, 127, -128, 127, -128]
    assert quantize_reference(STEPS, "half_even").tolist() == even + rest
    assert quantize_reference(STEPS, "half_away").tolist() == away + rest


@pytest.mark.parametrize("rounding", ["half_even", "half_away"])
def test_rounding_probe_reads_the_switch_and_derive_sets_it(rounding, fresh_compile_count):
    obs = run_suite(Emulator(STRICT.replace(quantize_rounding=rounding)), select(["int8."]))
    assert obs[ROUNDING].outcome == rounding and obs[ACCUM].outcome == "none"
    base = STRICT.replace(quantize_rounding="half_away" if rounding == "half_even" else "half_even")
    derived = derive_profile(obs, base=base)
    assert derived.quantize_rounding == rounding and "quantize_rounding" in derived.notes["measured"]
    assert "anomalies" not in derived.notes


def test_a_limited_int8_accumulator_is_read_and_noted(monkeypatch, fresh_compile_count):
    plain = emulator_int8.int_conv

    def limited(v, w, p):  # a device that sums int8 products in the fp16 accumulator's range
        acc = plain(v, w, p)
        return np.where(np.abs(acc) >= 32768, np.copysign(np.inf, acc), acc)

    monkeypatch.setattr(emulator_int8, "int_conv", limited)
    obs = run_suite(Emulator(STRICT), select([ACCUM]))
    assert obs[ACCUM].outcome == "16384"  # the smallest result's integer sum is 131,072
    assert ACCUM in derive_profile(obs).notes["anomalies"]
