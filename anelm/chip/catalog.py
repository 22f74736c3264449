"""Per-chip constants and the published figures, from one data file (anelm/data/ane_chips.json).

Every constant carries its source. A few are fitted on microbenchmark figures (`fitted_on`)
by the rules in `FIT_RULES`; the values in the file are frozen, and `refit()` recomputes them
from the figures so a test can prove the frozen numbers are what the fit gives. End-to-end
figures are never fitted: they are what `anelm bench validate` predicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..errors import UsageError

DATA_FILE = Path(__file__).resolve().parents[1] / "data" / "ane_chips.json"
CONSTANTS = ("conv_fp16_flops", "int8_ops", "matmul_flops", "dispatch_s", "working_set_bytes",
             "spill_slowdown", "ane_bytes_per_s", "compile_s", "cpu_sgemm_flops",
             "cpu_vector_bytes_per_s", "cpu_dram_bytes_per_s", "ane_transcendental_per_s",
             "ane_softmax_per_s", "ane_reduce_per_s", "cpu_exp_s")
# where published: the per-evaluation floor on another runtime's path; the cost per logit of a
# scalar (not vectorised) CPU cross-entropy, as Orion's is; the GPU's fp32 GEMM rate and memory
# bandwidth (train/steps/placement.py's `gpu` head); the CPU's performance cores, over which a pass
# split into chunks runs (bench/step_model.py `pass_bytes_per_s`; one where not published)
OPTIONAL = ("orion_dispatch_s", "cpu_scalar_ce_s", "gpu_sgemm_flops", "gpu_bytes_per_s", "cpu_performance_cores")
RMSNORM_BYTES_PER_ELEMENT = 32  # fp32: forward reads x twice, writes y; backward reads 4, writes dx
CPU_STREAM_BYTES_PER_ELEMENT = 8  # ANEForge's CPU streaming pass (relu / x*2): read and write fp32


@dataclass(frozen=True)
class Chip:
    key: str
    name: str
    values: dict[str, float]
    sources: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, item: str) -> float:
        values = object.__getattribute__(self, "values")
        if item in values:
            return values[item]
        raise AttributeError(item)


@lru_cache(maxsize=1)
def data() -> dict:
    return json.loads(DATA_FILE.read_text(encoding="utf-8"))


def chip_names() -> list[str]:
    return list(data()["chips"])


def get_chip(key: str | None = None) -> Chip:
    key = key or data()["default_chip"]
    chips = data()["chips"]
    if key not in chips:
        raise UsageError(f"unknown chip {key!r}; expected one of {', '.join(chips)} (anelm bench --chips)")
    entry = chips[key]
    missing = [c for c in CONSTANTS if c not in entry]
    assert not missing, f"{DATA_FILE}: chip {key} lacks {missing}"
    consts = [c for c, spec in entry.items() if isinstance(spec, dict)]
    unknown = [c for c in consts if c not in CONSTANTS + OPTIONAL]
    assert not unknown, f"{DATA_FILE}: chip {key} has unknown constants {unknown}"
    return Chip(key, entry["name"], {c: float(entry[c]["value"]) for c in consts},
                {c: entry[c]["source"] for c in consts})


def on_runtime(chip: Chip, runtime: str | None) -> Chip:
    """`chip` as a program sees it through another runtime's eval path (OPTIONAL `<runtime>_dispatch_s`):
    Orion builds a request and looks its program cache up on every evaluation."""
    floor = chip.values.get(f"{runtime}_dispatch_s") if runtime else None
    return chip if floor is None else Chip(chip.key, chip.name, {**chip.values, "dispatch_s": floor}, chip.sources)


def figures() -> list[dict]:
    return list(data()["figures"])


def figure(name: str) -> dict:
    for f in data()["figures"]:
        if f["name"] == name:
            return f
    raise KeyError(name)


def breakdowns() -> list[dict]:
    return list(data()["breakdowns"])


# --------------------------------------------------------------------------- the fit

def _chain_rate(fig: dict, chip: Chip) -> float:
    """Rate of a conv chain: its arithmetic over the time past one dispatch."""
    p = fig["program"]
    flops = 2 * p["channels"] ** 2 * p["spatial"] * p["depth"]
    return flops / (fig["published"] * 1e-3 - chip.dispatch_s)


def _rmsnorm_bandwidth(fig: dict, chip: Chip) -> float:
    p = fig["program"]
    return p["norms"] * RMSNORM_BYTES_PER_ELEMENT * p["dim"] * p["tokens"] / (fig["published"] * 1e-3)


def _cpu_stream_bandwidth(fig: dict, chip: Chip) -> float:
    """Bytes per second of a CPU elementwise pass over fp32 (read one, write one)."""
    p = fig["program"]
    return CPU_STREAM_BYTES_PER_ELEMENT * p["rows"] * p["cols"] / (fig["published"] * 1e-3)


def _eval_floor(fig: dict, chip: Chip) -> float:
    """Seconds of one evaluation of a program too small to cost anything but its dispatch."""
    return fig["published"] * 1e-3


def _vector_rate(fig: dict, chip: Chip) -> float:
    """Elements per second of a single-op program, past one dispatch."""
    p = fig["program"]
    return p["rows"] * p["cols"] / (fig["published"] * 1e-3 - chip.dispatch_s)


def _cpu_gemm_rate(fig: dict, chip: Chip) -> float:
    """FLOP/s of one fp32 n×n×n GEMM call on the CPU (its matrix units, as BLAS spreads it)."""
    n = fig["program"]["n"]
    return 2 * n ** 3 / (fig["published"] * 1e-3)


def _cpu_exp(fig: dict, chip: Chip) -> float:
    """Seconds per element of a CPU pass that takes an exp (a softmax row's work)."""
    p = fig["program"]
    return fig["published"] * 1e-3 / (p["rows"] * p["cols"])


# constant -> rule(figure named by `fitted_on`, chip) -> value; cpu_vector_bytes_per_s comes from
# the vDSP RMSNorm where a chip has one (M4), else from the CPU streaming pass (`rule` names it)
FIT_RULES = {
    "conv_fp16_flops": _chain_rate,
    "int8_ops": _chain_rate,
    "cpu_vector_bytes_per_s": _rmsnorm_bandwidth,
    "ane_transcendental_per_s": _vector_rate,
    "ane_softmax_per_s": _vector_rate,
    "ane_reduce_per_s": _vector_rate,
    "cpu_exp_s": _cpu_exp,
    "cpu_scalar_ce_s": _cpu_exp,
    "cpu_sgemm_flops": _cpu_gemm_rate,
    "cpu_stream": _cpu_stream_bandwidth,
    "orion_dispatch_s": _eval_floor,
}


def refit(key: str) -> dict[str, float]:
    """The fitted constants of chip `key`, recomputed from the figures they name."""
    chip, entry, out = get_chip(key), data()["chips"][key], {}
    for const, spec in entry.items():
        if not isinstance(spec, dict) or "fitted_on" not in spec:
            continue
        out[const] = FIT_RULES[spec.get("rule", const)](figure(spec["fitted_on"]), chip)
    return out
