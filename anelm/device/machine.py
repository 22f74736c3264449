"""Facts about this machine: OS, macOS version, CPU brand, Apple Silicon family, ANE framework.

Pure functions over injected inputs (`collect(system=..., run=...)`), so every branch is
tested on Linux. Nothing here touches the private framework: presence is a folder check,
because since macOS 11 system binaries live in the dyld shared cache and are not files.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass
from typing import Callable

from .ane import FRAMEWORK_DIR

# Apple Silicon generation → ANE architecture, as aneforge's family detection maps
# "Apple M<n>" (_targets.py detect_family). The M5 is reported as h17s by aneforge and as h16/h17
# by `_ANEDeviceInfo.aneSubType` (maderix/ANE#50); doctor measures behaviour, not names.
ANE_ARCH = {"M1": "h13", "M2": "h14", "M3": "h15", "M4": "h16", "M5": "h17"}

Runner = Callable[[list[str]], str]


@dataclass(frozen=True)
class MachineFacts:
    os: str  # platform.system(): Darwin, Linux, ...
    os_version: str  # macOS product version on Darwin, kernel release elsewhere
    arch: str  # what this Python runs as: arm64, x86_64, ...
    cpu_brand: str  # machdep.cpu.brand_string on Darwin, /proc/cpuinfo model name on Linux
    chip: str | None  # "M4 Pro"
    family: str | None  # "M4"
    ane_arch: str | None  # "h16"
    translated: bool  # an x86_64 Python under Rosetta on Apple Silicon
    ane_framework: bool  # AppleNeuralEngine.framework folder present

    @property
    def apple_silicon(self) -> bool:
        return self.family is not None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for `anelm doctor`."""
        if self.os == "Darwin":
            where = f"macOS {self.os_version or '?'} on {self.cpu_brand or 'an unknown CPU'}"
            if self.ane_arch:
                where += f" (ANE {self.ane_arch})"
            if self.translated:
                where += "; this Python runs under Rosetta"
            return where
        return f"{self.os} {self.os_version} ({self.arch}, {self.cpu_brand or 'unknown CPU'}): not Apple Silicon"


def chip_family(brand: str) -> tuple[str | None, str | None, str | None]:
    """`Apple M4 Pro` → ("M4 Pro", "M4", "h16"); anything else → (None, None, None).

    A new generation (M6) is recognised as Apple Silicon with an unknown ANE architecture.
    """
    m = re.search(r"\bApple (M(\d+))((?: [A-Za-z]+)*)", brand or "")
    if not m:
        return None, None, None
    family = m.group(1)
    return f"{family}{m.group(3)}".strip(), family, ANE_ARCH.get(family)


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _sysctl(run: Runner, name: str) -> str:
    return run(["sysctl", "-n", name])


def _linux_cpu(cpuinfo: str) -> str:
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return m.group(1).strip() if m else ""


def collect(system: str | None = None, machine: str | None = None, release: str | None = None,
            mac_version: str | None = None, run: Runner = _run, cpuinfo: str | None = None,
            framework_dir: str = FRAMEWORK_DIR) -> MachineFacts:
    """Gather the facts; each argument overrides one source (tests inject them)."""
    system = system if system is not None else platform.system()
    machine = machine if machine is not None else platform.machine()
    if system == "Darwin":
        version = mac_version if mac_version is not None else platform.mac_ver()[0]
        version = version or run(["sw_vers", "-productVersion"])  # mac_ver() is empty in some builds
        brand = _sysctl(run, "machdep.cpu.brand_string")
        translated = _sysctl(run, "sysctl.proc_translated") == "1"
    else:
        version = release if release is not None else platform.release()
        if cpuinfo is None:
            cpuinfo = _read("/proc/cpuinfo")
        brand, translated = _linux_cpu(cpuinfo), False
    chip, family, ane_arch = chip_family(brand)
    present = system == "Darwin" and os.path.isdir(framework_dir)
    return MachineFacts(system, version, machine, brand, chip, family, ane_arch, translated, present)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""
