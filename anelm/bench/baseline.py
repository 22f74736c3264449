"""`--save-baseline FILE` and `--baseline FILE` (docs/benchmarks.md).

Every numeric key ending in `_ms` (lower is better) or `_per_s` (higher is better), at any depth
of the printed object (nested keys are joined with dots; lists are skipped), is compared. A
metric fails when it got worse by more than its threshold (a rate by its time per unit: half
the rate is 100 % worse, as twice the milliseconds are):

    predicted_*     1 %: the model is deterministic; any move is a change of the model or a program
    emulator_cpu_*  100 %: the emulator by its thread's CPU time, best of `--repeat` runs
                    (bench/measure.py). Other processes move it little: of six reruns of `bench
                    train` and `bench generate --preset tiny` against a fresh baseline on the
                    shared 2-core machine, three beside a CPU-bound and a BLAS process, none
                    moved it by more than 6 % (train step, prefill) or 35 % (decode); once, in a
                    test run beside other work, decode moved 76 %. A slowdown of the emulator's
                    code moves it as much as the wall clock: twice the CPU time fails
    emulator_*      400 %: the same runs by the wall clock, for a person to read: they took up
                    to 3x (train step) and 4.5x (decode), and single runs of a busy afternoon
                    1.5-2.6x, so only a change past 5x shows here
    measured_*      10 %: repeated ANE runs (maderix's 20-step table and its README differ by ~20 %
                    between sessions; one session's runs agree far better)
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import AnelmError

THRESHOLDS = {"predicted": 0.01, "emulator_cpu": 1.00, "emulator": 4.00, "measured": 0.10}  # first match wins
DEFAULT_THRESHOLD = 0.10


def metrics(obj, prefix: str = "") -> dict[str, float]:
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                out.update(metrics(v, name + "."))
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and k.endswith(("_ms", "_per_s")):
                out[name] = float(v)
    return out


def threshold(name: str) -> float:
    for part in name.split("."):  # predicted_breakdown.rmsnorm_ms is a predicted figure
        for kind, t in THRESHOLDS.items():
            if part.startswith(kind):
                return t
    return DEFAULT_THRESHOLD


def save(result: dict, path: str) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def load(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AnelmError(f"baseline {path} not found; expected a file written by --save-baseline") from None
    except (OSError, json.JSONDecodeError) as e:
        raise AnelmError(f"baseline {path} is not a JSON object written by --save-baseline ({e})") from None
    if not isinstance(data, dict):
        raise AnelmError(f"baseline {path}: expected a JSON object, found {type(data).__name__}")
    return data


def regressions(result: dict, base: dict) -> list[str]:
    """One line per metric that got worse than `base` by more than its threshold."""
    now, before = metrics(result), metrics(base)
    bad = []
    for name, old in sorted(before.items()):
        new = now.get(name)
        if new is None or old == 0:
            continue
        # a rate is judged by the time per unit, so that one threshold means the same slowdown
        # for both kinds (2x the ms, or half the rate, are 100 % worse)
        lower_better = name.endswith("_ms")
        worse = (new - old) / old if lower_better else (old / new - 1 if new > 0 else float("inf"))
        if worse > threshold(name):
            bad.append(f"{name} got worse by {100 * worse:.1f} % ({old:.4g} -> {new:.4g}; "
                       f"threshold {100 * threshold(name):.0f} %)")
    return bad
