"""Chip profiles: the hardware behaviours the emulator reproduces and the compiler avoids.

A profile is a JSON file (`--profile PATH` or `ANELM_PROFILE`). The built-in default is
`strict`, the closed list in docs/chip-profiles.md. Behaviours that peers report but disagree on are
named switches here, off in `strict`; `anelm doctor` measures them on real chips and writes
a profile in this schema.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import AnelmError

PROFILE_DIR = Path(__file__).parent / "profiles"
# The working set past which ANE time climbs, as measured on the default chip (anelm/data/
# ane_chips.json: 4.72 MB on the H16 family, 2.3 MB on M1; it replaces a retracted 32 MiB figure).
SRAM_BYTES = int(json.loads((Path(__file__).resolve().parents[1] / "data" / "ane_chips.json").read_text())
                 ["chips"]["m4"]["working_set_bytes"]["value"])


@dataclass(frozen=True)
class ChipProfile:
    name: str = "strict"
    # --- compile-time rejects (their messages: chip/rejects.py) ---
    rejected_ops: tuple[str, ...] = ("concat", "gelu")
    reject_conv_bias: bool = True
    reject_dynamic_conv_weight: bool = True  # conv weight must be const or constexpr_* result
    reject_inline_matmul_transpose: bool = True  # transpose_x/_y must be named consts
    # --- binding and surfaces: alphabetical binding, uniform sizes, the 49,152-byte minimum ---
    bind_inputs_alphabetically: bool = True
    bind_outputs_alphabetically: bool = True
    uniform_input_sizes: bool = True
    uniform_output_sizes: bool = True
    min_surface_bytes: int = 49152
    # --- semantics: SDPA's mask, weights read at compile, the compile budget, fp16 ---
    sdpa_ignores_mask: bool = True
    reload_reads_new_weights: bool = False
    compile_budget: int = 115  # libane stops at 115, the compiler fails near 119
    compute_dtype: str = "fp16"
    cast_only_at_boundary: bool = True
    # --- the conv/matmul accumulator ---
    accumulator_limit: float | None = 32768  # |result| >= limit is +-inf; None: no limit
    accumulator: str = "fp32"  # "fp32", or "q15.16": fixed point, LSB 2^-16, partial sums limited
    # quantize's ties: MIL's reference rounds half to even; the M6 study saw fp16 outputs round
    # half away from zero. Unmeasured for quantize itself; see device/emulator/int8.py
    quantize_rounding: str = "half_even"
    # --- I/O widths (the 16-column spatial multiple): the last dim of every input and output
    # surface. Orion saw S = 1 compile, then fail at evaluation; rustane, silent corruption at
    # other widths. The compiler's kernels pad to it; the doctor's io.spatial probes may relax
    # it per chip ---
    spatial_multiple_of: int = 16
    # --- peer-reported switches, off in strict ---
    single_input_only: bool = False  # maderix: multi-input requests give 0x1d
    reject_reduce_mean: bool = False  # Espresso authors: no reduce_mean in raw MIL
    reject_rsqrt: bool = False  # rustane: rsqrt/sqrt fail after a reduce
    single_chunk_blobs_only: bool = False  # M1: multi-chunk blob files fail
    saturate_above: float | None = None  # A13/A14 Q.4x16 activations saturate at |x| > 4094
    notes: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d["rejected_ops"] = list(self.rejected_ops)
        return json.dumps(d, indent=2, sort_keys=False) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json())

    def replace(self, **changes) -> "ChipProfile":
        d = asdict(self)
        d.update(changes)
        return ChipProfile.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> "ChipProfile":
        unknown = sorted(set(d) - set(FIELD_CHECKS))
        if unknown:
            raise AnelmError(f"{source}: unknown chip-profile key(s) {unknown}; "
                             f"expected some of {sorted(FIELD_CHECKS)}")
        for name, value in d.items():
            expected = FIELD_CHECKS[name](value)
            if expected:
                raise AnelmError(f"{source}: chip-profile field '{name}' must be {expected}, got {_shown(value)}")
        if "rejected_ops" in d:
            d["rejected_ops"] = tuple(d["rejected_ops"])
        return cls(**d)


# --- validation: one check per field, each returning what was expected when a value is wrong ---

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is no count


def _int_at_least(low: int):
    return lambda v: None if _is_int(v) and v >= low else f"an integer >= {low}"


def _positive_or_null(v):
    ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    return None if ok else "a positive number or null"


def _one_of(*allowed: str):
    return lambda v: None if isinstance(v, str) and v in allowed else "one of " + ", ".join(map(json.dumps, allowed))


def _op_names(v):
    from ..ir.ops import OP_TABLE  # the emulator's op table: the ops a profile can name

    if not isinstance(v, (list, tuple)) or not all(isinstance(o, str) for o in v):
        return "a list of op names"
    unknown = [o for o in v if o not in OP_TABLE]
    return f"a list of known op names ({', '.join(map(repr, unknown))} not in {sorted(OP_TABLE)})" if unknown else None


def _of_type(kind: type, what: str):
    return lambda v: None if isinstance(v, kind) else what


FIELD_CHECKS = {
    "name": _of_type(str, "a string"),
    "rejected_ops": _op_names,
    "min_surface_bytes": _int_at_least(0),
    "compile_budget": _int_at_least(1),
    "compute_dtype": _one_of("fp16", "fp32"),
    "spatial_multiple_of": _int_at_least(1),
    "saturate_above": _positive_or_null,
    "accumulator_limit": _positive_or_null,
    "accumulator": _one_of("fp32", "q15.16"),
    "quantize_rounding": _one_of("half_even", "half_away"),
    "notes": _of_type(dict, "a JSON object"),
}
FIELD_CHECKS.update({f.name: _of_type(bool, "true or false") for f in fields(ChipProfile) if f.type == "bool"})
assert set(FIELD_CHECKS) == {f.name for f in fields(ChipProfile)}, "every profile field needs a check"


def _shown(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


STRICT = ChipProfile()


def padded_width(n: int, multiple: int) -> int:
    """The smallest I/O width >= n that is a multiple of `multiple` (spatial_multiple_of)."""
    return -(-int(n) // multiple) * multiple


def load_profile(spec: str | os.PathLike | None = None) -> ChipProfile:
    """Load a profile by path or built-in name; `None` reads `ANELM_PROFILE`, else `strict`."""
    spec = spec if spec is not None else os.environ.get("ANELM_PROFILE")
    if spec is None or spec == "strict":
        return STRICT
    path = Path(spec)
    if not path.exists() and (PROFILE_DIR / f"{spec}.json").exists():
        path = PROFILE_DIR / f"{spec}.json"
    if not path.exists():
        raise AnelmError(f"chip profile '{spec}' not found; expected a JSON file path or 'strict'")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AnelmError(f"chip profile '{path}' is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise AnelmError(f"chip profile '{path}' must be a JSON object")
    return ChipProfile.from_dict(data, source=str(path))
