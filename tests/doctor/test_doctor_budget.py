"""`anelm doctor --budget N`: N cold compiles in a child, each checked, written to the profile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from anelm.cli.main import main
from anelm.device.emulator import Emulator
from anelm.chip.profile import STRICT, load_profile
from anelm.doctor.harness import Harness
from anelm.doctor.suite import budget_probe


class Recording(Emulator):
    """An emulator that records each program and, past `good` compiles, computes garbage."""

    def __init__(self, good: int = 10**9):
        super().__init__(STRICT.replace(compile_budget=10**9))
        self.texts, self.good = [], good

    def compile(self, mil_text, weights, key=None):
        self.texts.append(mil_text)
        return super().compile(mil_text, weights, key=key)

    def evaluate(self, model, inputs, outputs):
        super().evaluate(model, inputs, outputs)
        if len(self.texts) > self.good:  # the silent failures libane reports before the crash
            outputs[0].write(np.zeros(outputs[0].nbytes, np.uint8))


def test_each_run_compiles_programs_no_cache_holds():
    a, b = Recording(), Recording()
    assert budget_probe(3).run(Harness(a)).value == "3" and budget_probe(3).run(Harness(b)).value == "3"
    assert len(set(a.texts)) == 3 and not set(a.texts) & set(b.texts)  # a fresh nonce per run


def test_a_compile_that_computes_garbage_is_not_a_good_one():
    obs = budget_probe(20).run(Harness(Recording(good=6)))
    assert obs.value == "6" and "compile 7 ran but computed a wrong result" in obs.detail


def test_doctor_budget_n_is_written_into_the_profile(tmp_path, capsys):
    raised = tmp_path / "raised.json"
    STRICT.replace(name="generous", compile_budget=130).save(raised)
    out = tmp_path / "chip.json"
    args = ["doctor", "--device", "emulator", "--probe", "op.add", "--budget", "125", "--json"]
    assert main(args + ["--profile", str(raised), "--write-profile", str(out)]) == 0
    row = {p["probe"]: p for p in json.loads(capsys.readouterr().out)["probes"]}["budget.compiles"]
    assert row["emulator"]["outcome"] == "125" and row["expected"] == "125"
    assert load_profile(str(out)).compile_budget == 125
    assert main(args + ["--write-profile", str(out)]) == 0  # strict: the emulator stops at 115
    row = {p["probe"]: p for p in json.loads(capsys.readouterr().out)["probes"]}["budget.compiles"]
    assert row["emulator"]["outcome"] == row["expected"] == "115"
    assert load_profile(str(out)).compile_budget == 115


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_doctor_budget_needs_a_positive_count(bad, capsys):
    assert main(["doctor", "--device", "emulator", "--no-conformance", "--budget", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anelm: error:") and "--budget" in err[0]
