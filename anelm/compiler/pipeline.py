"""The compiler pipeline: ONE ordered list of passes, then codegen and the Artifact.

    compile_graph(graph, profile=STRICT) -> Artifact(mil_text, weights, signature, meta)

`ANELM_DEBUG=1` runs `verify` before the first pass and after every pass; `ANELM_DEBUG=2`
also prints the graph after each pass to stderr. The caller's graph is never modified.
"""

from __future__ import annotations

import os
import sys

from ..chip.profile import STRICT, ChipProfile
from ..ir.graph import Graph
from .registry import run_pass
from .verify import verify

MAX_ROUNDS = 20  # fixed-point groups stop here (Orion's optimizer bound)

# A name runs once; a tuple of names repeats, in order, until a whole round changes nothing.
PIPELINE: list[str | tuple[str, ...]] = [
    # Conservative forms first: gelu, silu, reduce_mean, rsqrt, layer_norm, SDPA
    # (its mask is ignored by the hardware) become ops every chip takes. Later passes then
    # see only those ops, and folding can clean up the consts the rewrites introduce.
    "decompose",
    # ANE conv takes no bias (a compile-time reject): conv + add of a [1, C, 1, 1] const.
    "conv_bias_split",
    # Cleanup to a fixed point: folding exposes identities (a reshape of a folded const), cast
    # fusion exposes same-dtype casts, and DCE drops what they all leave behind.
    ("constant_folding", "identity_elimination", "cast_fusion", "dead_code_elimination"),
    # Casts may remain only on inputs or returned values (fp16 computation); a check, no rewrite.
    "cast_placement",
    # A returned concat becomes one output per part (concat is a compile-time reject); the
    # runtime reassembles it from meta["concat_outputs"]. DCE removes what fed only the concat.
    "concat_elimination",
    "dead_code_elimination",
    # Now that the returned values are final: MIL names that sort in declared order (alphabetical binding).
    "io_naming",
    # Annotations and the last word: surface sizes (uniform, at least 49,152 bytes), the constraint
    # catalogue of the profile, the working set (a warning past the measured threshold), and
    # the cost of one evaluation (FLOPs by unit, bytes) that anelm.bench turns into time.
    "uniform_surfaces",
    "ane_validate",
    "sram_estimate",
    "cost_annotate",
]


def _debug_level() -> int:
    try:
        return int(os.environ.get("ANELM_DEBUG", "0") or 0)
    except ValueError:
        return 0


def _run(name: str, graph: Graph, profile: ChipProfile, level: int) -> bool:
    changed = run_pass(name, graph, profile)
    if level >= 1:
        verify(graph, after=name)
    if level >= 2:
        print(f"--- after {name}{'' if changed else ' (no change)'}\n{graph}", file=sys.stderr)
    return changed


def run_pipeline(graph: Graph, profile: ChipProfile = STRICT, passes=None) -> Graph:
    """A rewritten copy of `graph` after `passes` (default PIPELINE); meta["passes"] lists changes."""
    g = graph.copy()
    level = _debug_level()
    if level >= 1:
        verify(g, after="(input)")
    applied: list[str] = []
    for entry in PIPELINE if passes is None else passes:
        group = (entry,) if isinstance(entry, str) else tuple(entry)
        for _ in range(MAX_ROUNDS if isinstance(entry, tuple) else 1):
            changed = [name for name in group if _run(name, g, profile, level)]
            applied += changed
            if not changed:
                break
    g.meta["passes"] = applied
    return g


def compile_graph(graph: Graph, profile: ChipProfile = STRICT, name: str | None = None):
    """Run the pipeline, emit MIL and weights, and package them with signature and meta."""
    from .codegen import emit
    from ..mil.text import print_program
    from .artifact import Artifact, signature_from_function

    g = run_pipeline(graph, profile)
    program, weights = emit(g)
    meta = {
        "name": name or graph.name,
        "profile": profile.name,
        "aliases": dict(g.meta.get("aliases", {})),
        "concat_outputs": dict(g.meta.get("concat_outputs", {})),
        "surface_bytes": g.meta.get("surface_bytes"),
        "sram": g.meta.get("sram"),
        "cost": g.meta.get("cost"),
        "warnings": list(g.meta.get("warnings", [])),
        "passes": g.meta["passes"],
    }
    signature = signature_from_function(program.main, profile)
    return Artifact(print_program(program), weights, signature, meta)
