"""`anelm doctor`'s conformance suite: small MIL programs that pin down what a chip does.

Each probe is MIL text written here with a float64 numpy reference and a tolerance
(docs/testing.md), run through the Device interface with the surfaces it asks for. Graded:
1 single ops, 2 binding order and surface sizes, 3 compile rejects and semantics the
references disagree on, 4 transformer kernels, 5 the compile budget (child process only).

    from anelm.doctor import all_probes, run_suite, derive_profile
    obs = run_suite(Emulator(STRICT), all_probes())
    derive_profile(obs)            # == STRICT's switches: the emulator agrees with its own profile

On a Mac the same probes run on the ANE (`isolate.run_isolated("ane", ...)`), and the
profile derived from the hardware's observations is what `anelm doctor --write-profile` saves.
"""

from .derive import derive_profile
from .harness import Observation, Probe, rel_err, run_probe
from .isolate import Isolated, run_isolated
from .suite import BUDGET_PROBE, Row, all_probes, format_table, rows, run_suite, select, unprobed_ops

__all__ = ["BUDGET_PROBE", "Isolated", "Observation", "Probe", "Row", "all_probes", "derive_profile",
           "format_table", "rel_err", "rows", "run_isolated", "run_probe", "run_suite", "select", "unprobed_ops"]
