"""Machine facts, from injected command output and files, so every branch runs on Linux."""

from __future__ import annotations

import platform

import pytest

from anelm.device import machine


@pytest.mark.parametrize("brand, expected", [
    ("Apple M1", ("M1", "M1", "h13")),
    ("Apple M2 Max", ("M2 Max", "M2", "h14")),
    ("Apple M3 Pro", ("M3 Pro", "M3", "h15")),
    ("Apple M4", ("M4", "M4", "h16")),
    ("Apple M5", ("M5", "M5", "h17")),
    ("Apple M6 Ultra", ("M6 Ultra", "M6", None)),  # a new generation: Apple Silicon, arch unknown
    ("Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz", (None, None, None)),
    ("", (None, None, None)),
])
def test_chip_family(brand, expected):
    assert machine.chip_family(brand) == expected


def _runner(answers: dict):
    calls = []

    def run(cmd):
        calls.append(cmd)
        return answers.get(" ".join(cmd), "")
    run.calls = calls
    return run


def test_collect_on_a_mac(tmp_path):
    run = _runner({"sysctl -n machdep.cpu.brand_string": "Apple M4 Pro", "sysctl -n sysctl.proc_translated": "0"})
    facts = machine.collect(system="Darwin", machine="arm64", mac_version="15.3.1", run=run,
                            framework_dir=str(tmp_path))
    assert facts == machine.MachineFacts("Darwin", "15.3.1", "arm64", "Apple M4 Pro", "M4 Pro", "M4", "h16",
                                         False, True)
    assert facts.apple_silicon
    assert facts.describe() == "macOS 15.3.1 on Apple M4 Pro (ANE h16)"


def test_collect_under_rosetta_and_without_the_framework(tmp_path):
    run = _runner({"sysctl -n machdep.cpu.brand_string": "Apple M1", "sysctl -n sysctl.proc_translated": "1",
                   "sw_vers -productVersion": "14.6"})
    facts = machine.collect(system="Darwin", machine="x86_64", mac_version="", run=run,
                            framework_dir=str(tmp_path / "absent"))
    assert facts.translated and facts.os_version == "14.6" and not facts.ane_framework
    assert "Rosetta" in facts.describe()


def test_collect_on_linux_reads_cpuinfo_and_never_runs_sysctl():
    run = _runner({})
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n"
    facts = machine.collect(system="Linux", machine="x86_64", release="6.8.0", run=run, cpuinfo=cpuinfo)
    assert (facts.cpu_brand, facts.family, facts.ane_framework, facts.os_version) == ("AMD EPYC 7B13", None, False, "6.8.0")
    assert run.calls == []
    assert facts.describe().endswith("not Apple Silicon")


def test_collect_here_matches_the_platform():
    facts = machine.collect()
    assert facts.os == platform.system() and facts.arch == platform.machine()
    assert set(facts.to_dict()) >= {"os", "os_version", "chip", "ane_arch", "ane_framework"}
