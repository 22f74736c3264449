"""The pass registry (coremltools' `@register_pass`, tinygrad's passes-as-data).

A pass is a function `pass_fn(graph, profile=STRICT) -> Graph | None`: it rewrites `graph`
in place and returns it when something changed, or returns None for "no change". The
docstring of each pass shows the MIL before and after. `compiler/pipeline.py` orders the
registered names in one commented list.
"""

from __future__ import annotations

from typing import Callable

from ..chip.profile import STRICT, ChipProfile
from ..ir.graph import Graph

PassFn = Callable[..., "Graph | None"]
PASSES: dict[str, PassFn] = {}


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    """Register `fn` under `name`; the name is what `pipeline.PIPELINE` lists."""
    def deco(fn: PassFn) -> PassFn:
        assert name not in PASSES, f"pass '{name}' registered twice"
        fn.pass_name = name  # type: ignore[attr-defined]
        PASSES[name] = fn
        return fn
    return deco


def get_pass(name: str) -> PassFn:
    _load_passes()
    if name not in PASSES:
        raise KeyError(f"no pass named '{name}'; registered: {sorted(PASSES)}")
    return PASSES[name]


def run_pass(name: str, graph: Graph, profile: ChipProfile = STRICT) -> bool:
    """Run one pass on `graph` (in place); True when it changed something."""
    out = get_pass(name)(graph, profile)
    assert out is None or out is graph, f"pass '{name}' must rewrite in place and return the graph or None"
    return out is not None


def _load_passes() -> None:
    """Registration is by import: each module under compiler/passes registers its passes."""
    from .passes import cleanup, cost, decompose, layout, validate  # noqa: F401
