"""Observed behaviour → chip profile: the inverse of each probe's `expect(profile)`.

A switch is set only from the probe that measures it; a switch whose probe did not run, or
gave an outcome that settles nothing (a crash, a reading no rule predicts), keeps the base
profile's value and is listed in `notes["unmeasured"]`, with the odd readings under
`notes["anomalies"]`. A wrong result is treated like a reject where the switch is a reject:
the compiler must avoid the form either way.
"""

from __future__ import annotations

from ..chip.profile import STRICT, ChipProfile
from .harness import Observation
from .probes_accum import CANCEL, CANCEL_PEAK, LIMIT_PROBES, RUNGS, TINY
from .probes_int8 import ACCUM, MODES, ROUNDING
from .probes_io import LADDER, WIDTHS
from .suite import BUDGET_PROBE

FAILED = ("rejected", "wrong-result", "error")
OWN_SWITCH_OPS = ("reduce_mean", "rsqrt")  # these have their own switches, not rejected_ops

# switch -> (probe, outcome meaning True, outcome meaning False)
BOOLEAN_SWITCHES = {
    "reject_conv_bias": ("compile.conv_bias", FAILED, ("ok",)),
    "reject_dynamic_conv_weight": ("compile.conv_dynamic_weight", FAILED, ("ok",)),
    "reject_inline_matmul_transpose": ("compile.matmul_inline_transpose", FAILED, ("ok",)),
    "single_input_only": ("io.single_input", ("error",), ("ok",)),
    "bind_inputs_alphabetically": ("bind.inputs", ("alphabetical",), ("declared",)),
    "bind_outputs_alphabetically": ("bind.outputs", ("alphabetical",), ("declared",)),
    "uniform_output_sizes": ("io.mixed_output_sizes", ("error",), ("ok",)),
    "sdpa_ignores_mask": ("sem.sdpa_mask", ("ignored",), ("applied",)),
    "reload_reads_new_weights": ("sem.reload_weights", ("new",), ("old",)),
    "cast_only_at_boundary": ("compile.cast_inside", ("rejected",), ("ok",)),
    "single_chunk_blobs_only": ("sem.multi_chunk_blob", FAILED, ("ok",)),
    "reject_reduce_mean": ("op.reduce_mean", FAILED, ("ok",)),
}


def derive_profile(observations: dict[str, Observation] | list[Observation], base: ChipProfile = STRICT,
                   name: str = "observed", notes: dict | None = None) -> ChipProfile:
    """The profile a device showing `observations` follows; unmeasured switches come from `base`."""
    obs = observations if isinstance(observations, dict) else {o.probe: o for o in observations}
    out = {k: o.outcome for k, o in obs.items()}
    changes, measured, anomalies = {}, [], {}

    def settle(switch: str, value) -> None:
        changes[switch] = value
        measured.append(switch)

    for switch, (probe, yes, no) in BOOLEAN_SWITCHES.items():
        if out.get(probe) in yes or out.get(probe) in no:
            settle(switch, out[probe] in yes)
        elif probe in out and not (out[probe] == "error" and changes.get("single_input_only")):
            anomalies[probe] = f"{out[probe]}: {obs[probe].detail}"[:200]
    _uniform_inputs(out, changes, settle)
    _rsqrt(out, settle)
    _rejected_ops(out, base, settle)
    _min_surface(out, settle, anomalies)
    _spatial(out, settle)
    _values(out, settle, anomalies)
    _accumulator(out, settle, anomalies)
    _int8(out, settle, anomalies)
    unmeasured = sorted(set(_switches()) - set(measured))
    meta = {**(notes or {}), "measured": sorted(measured), "unmeasured": unmeasured}
    if anomalies:
        meta["anomalies"] = anomalies
    return base.replace(name=name, notes=meta, **changes)


def _switches() -> list[str]:
    return [f for f in ChipProfile.__dataclass_fields__ if f not in ("name", "notes")]


def _uniform_inputs(out: dict, changes: dict, settle) -> None:
    # two input surfaces are needed to see it: unmeasurable when the chip takes one input only
    o = out.get("io.mixed_input_sizes")
    if changes.get("single_input_only") is False and o in ("error", "ok"):
        settle("uniform_input_sizes", o == "error")


def _rsqrt(out: dict, settle) -> None:
    seen = [out[p] for p in ("op.rsqrt", "kernel.sqrt_after_reduce") if p in out]
    if any(o in FAILED for o in seen):
        settle("reject_rsqrt", True)
    elif seen and all(o == "ok" for o in seen):
        settle("reject_rsqrt", False)


def _rejected_ops(out: dict, base: ChipProfile, settle) -> None:
    probed = {k[3:]: o for k, o in out.items() if k.startswith("op.")}
    if not probed:
        return
    ok = {op for op, o in probed.items() if o == "ok"}
    bad = {op for op, o in probed.items() if o in FAILED}
    settle("rejected_ops", tuple(sorted(((set(base.rejected_ops) - ok) | bad) - set(OWN_SWITCH_OPS))))


def _min_surface(out: dict, settle, anomalies: dict) -> None:
    rungs = [(n, out.get(f"io.min_surface.{n}")) for n in LADDER]
    if any(o is None for _, o in rungs):
        return
    ok_from = None  # the smallest size from which every larger size works
    for n, o in reversed(rungs):
        if o != "ok":
            break
        ok_from = n
    if ok_from is None:
        anomalies["io.min_surface"] = f"even {LADDER[-1]}-byte surfaces fail"
    else:
        settle("min_surface_bytes", ok_from)


def _spatial(out: dict, settle) -> None:
    got = {w: out.get(f"io.spatial.{w}") for w in WIDTHS}
    if any(o is None for o in got.values()):
        return
    # WIDTHS are multiples of exactly 1, 8 and 16: the first width that works names the multiple
    for w, multiple in zip(WIDTHS, (1, 8, 16)):
        if got[w] == "ok":
            settle("spatial_multiple_of", multiple)
            return
    settle("spatial_multiple_of", 32)  # none worked: at least 32 (unmeasured beyond)


def _values(out: dict, settle, anomalies: dict) -> None:
    dtype = out.get("sem.fp16_overflow")
    if dtype in ("fp16", "fp32"):
        settle("compute_dtype", dtype)
    sat = out.get("sem.saturation")
    if sat in ("saturates", "ok"):
        settle("saturate_above", 4094.0 if sat == "saturates" else None)  # the A13/A14 threshold
    budget = out.get(BUDGET_PROBE)
    if budget is not None and budget.isdigit():
        settle("compile_budget", int(budget))
    elif budget is not None:
        anomalies[BUDGET_PROBE] = budget
    if out.get("compile.undefined_return") == "ok":
        anomalies["compile.undefined_return"] = "the compiler accepted an undefined returned name"
    if out.get("io.packed_read") not in (None, "ok"):
        anomalies["io.packed_read"] = f"{out['io.packed_read']}: reads are not packed at offset 0"


def _accumulator(out: dict, settle, anomalies: dict) -> None:
    """accumulator_limit from the ladders (the first rung that is inf), accumulator from the
    precision probes: tiny products dropped, or a partial sum that stuck at inf, mean q15.16."""
    limits = {p: out[p] for p in LIMIT_PROBES if out.get(p) == "none" or str(out.get(p)).isdigit()}
    if out.get("sem.saturation") == "saturates" and set(limits.values()) == {str(int(RUNGS[0]))}:
        limits = {}  # activations saturate below the lowest rung: the limit is hidden behind them
    limit = "unmeasured"
    if limits:
        numbers = [int(v) for v in limits.values() if v != "none"]
        limit = min(numbers) if numbers else None  # where conv and matmul differ, the lower limit binds
        if len(set(limits.values())) > 1:
            anomalies["acc.limit"] = f"conv and matmul disagree: {limits}; the lower one is recorded"
        settle("accumulator_limit", limit)
    votes = set()
    if out.get(TINY) in ("dropped", "kept"):
        votes.add("q15.16" if out[TINY] == "dropped" else "fp32")
    if out.get(CANCEL) == "sticky":
        votes.add("q15.16")
    elif out.get(CANCEL) == "cancels" and limit not in ("unmeasured", None) and limit <= CANCEL_PEAK:
        votes.add("fp32")  # the partial sum passed a limit it should have stuck at
    if len(votes) == 1:
        settle("accumulator", votes.pop())
    elif votes:
        anomalies["acc.precision"] = f"{TINY} {out.get(TINY)} but {CANCEL} {out.get(CANCEL)}: they disagree"


def _int8(out: dict, settle, anomalies: dict) -> None:
    """quantize_rounding from the ties probe. The int8 accumulator has no switch (int32 by every
    source, exempt from the fp16 accumulator limit of 32768): a limited reading that saturating
    activations do not explain is odd."""
    if out.get(ROUNDING) in MODES:
        settle("quantize_rounding", out[ROUNDING])
    acc = out.get(ACCUM)
    if acc is not None and acc != "none" and not (out.get("sem.saturation") == "saturates" and acc.isdigit()):
        anomalies[ACCUM] = f"{acc}: the int8 path is not an unlimited int32 sum (quantized kernels may overflow)"
