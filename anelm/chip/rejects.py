"""The compile-reject rules of the chip profile (docs/chip-profiles.md), one entry per rule,
keyed by the profile field that switches it on (or by a name, for the rules every profile has).

The compiler's validation (`compiler/passes/validate.py`, on the graph) and the emulator's
compile checks (`device/emulator/checks.py`, on parsed MIL) look at different forms of a
program, so each finds a broken rule its own way; both then raise the error of this table, so
a rule reads the same whichever of the two meets it first:

    if rule_on("reject_conv_bias", profile) and ...:
        raise reject("reject_conv_bias", node, profile)

A message names what broke (the op, the tensor, the count) and where the rule is written; the
fix says what a program does instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from ..errors import CompileError
from .profile import ChipProfile


@dataclass(frozen=True)
class Rule:
    constraint: str  # str.format template over the facts a check passes, and {profile}
    fix: str
    on: Callable[[ChipProfile], bool]  # whether the profile has the rule
    # False for a behaviour the device reproduces rather than refuses (the emulator runs it as
    # the hardware does); the compiler still refuses to emit it, since the result would be wrong
    device_rejects: bool = True


def _switch(field: str) -> Callable[[ChipProfile], bool]:
    return lambda p: bool(getattr(p, field))


def _always(_: ChipProfile) -> bool:
    return True


RULES: dict[str, Rule] = {
    # --- every profile -----------------------------------------------------------------------
    "op_table": Rule("op '{op}' is not in the emulator's op table (see docs/chip-profiles.md)",
                     "express it with ops the table has", _always),
    "returned_name": Rule("returned name is defined by no statement (see docs/chip-profiles.md)",
                          "return a variable that a statement binds (not an input)", _always),
    # --- profile fields ----------------------------------------------------------------------
    "rejected_ops": Rule("op '{op}' is rejected by profile '{profile}' (see docs/chip-profiles.md)", "{op_fix}",
                         _switch("rejected_ops")),
    "reject_conv_bias": Rule("conv has a bias argument (see docs/chip-profiles.md)",
                             "run conv_bias_split: conv without bias, then add a [1, C, 1, 1] const",
                             _switch("reject_conv_bias")),
    "reject_dynamic_conv_weight": Rule(
        "conv weight '{weight}' is {what}, not a const or a constexpr_* result (see docs/chip-profiles.md)",
        "for runtime weights use matmul (the dynamic-weight pattern of maderix/ANE's training_dynamic)",
        _switch("reject_dynamic_conv_weight")),
    "reject_inline_matmul_transpose": Rule("matmul has an inline {flag} literal (see docs/chip-profiles.md)",
                                           "bind {flag} to a named bool const",
                                           _switch("reject_inline_matmul_transpose")),
    "cast_only_at_boundary": Rule(
        "cast is allowed only directly on a function input or on a returned value "
        "(fp16 computation; see docs/chip-profiles.md)",
        "compute in fp16 and cast only the inputs or the returned values", _switch("cast_only_at_boundary")),
    "sdpa_ignores_mask": Rule("the hardware ignores scaled_dot_product_attention's attn_mask "
                              "(see docs/chip-profiles.md)",
                              "decompose attention: matmul, scale, add the mask, softmax, matmul",
                              _switch("sdpa_ignores_mask"), device_rejects=False),
    "spatial_multiple_of": Rule(
        "I/O tensor's last dim {width} is not a multiple of {multiple} "
        "(profile '{profile}'; see docs/chip-profiles.md)",
        "pad the spatial axis to a multiple of {multiple} (zero columns the program's results do not read)",
        lambda p: p.spatial_multiple_of > 1),
    "single_input_only": Rule("{count} input surfaces; profile '{profile}' accepts one input",
                              "pack the inputs along the spatial axis of one input", _switch("single_input_only")),
    "reject_reduce_mean": Rule("op 'reduce_mean' is rejected by profile '{profile}'", "use reduce_sum × 1/N",
                               _switch("reject_reduce_mean")),
    "reject_rsqrt": Rule("op '{op}' is rejected by profile '{profile}' (rsqrt, and sqrt of a reduce's result)",
                         "use pow(x, -0.5) or pow(x, 0.5)", _switch("reject_rsqrt")),
    "single_chunk_blobs_only": Rule(
        "blob file {path} holds {chunks} chunks; profile '{profile}' accepts single-chunk blob files only",
        "write one blob file per tensor", _switch("single_chunk_blobs_only")),
}
assert all(k in {f.name for f in fields(ChipProfile)} for k in RULES if k not in ("op_table", "returned_name")), \
    "a rule is keyed by a chip-profile field"

# what to write instead of an op a profile rejects
REJECTED_OP_FIX = {
    "concat": "run the concat_elimination pass, or return the parts as separate outputs",
    "gelu": "run the decompose pass, or write it out (the tanh form from mul/add/tanh)",
}


def rule_on(key: str, profile: ChipProfile) -> bool:
    return RULES[key].on(profile)


def reject(key: str, node: str, profile: ChipProfile, **facts) -> CompileError:
    """The CompileError of rule `key` at `node`, its templates filled from `facts`."""
    rule = RULES[key]
    if key == "rejected_ops":
        facts.setdefault("op_fix", REJECTED_OP_FIX.get(facts["op"], "decompose it into supported ops"))
    facts["profile"] = profile.name
    return CompileError(node, rule.constraint.format(**facts), rule.fix.format(**facts))


def rejected_sqrt(op: str, operand_op: str | None) -> bool:
    """The `reject_rsqrt` condition: rsqrt anywhere, sqrt whose operand a reduce produced."""
    return op == "rsqrt" or (op == "sqrt" and operand_op is not None and operand_op.startswith("reduce_"))
