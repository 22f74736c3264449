"""Helpers any test folder imports by name (`from helpers import ...`): pyproject puts tests/
on pytest's `pythonpath`, so they import the same way whichever folders a run collects.

`../shared` (beside the repo) holds external fixtures: MIL conformance programs and real
tokenizer files. It is not part of a user's clone, so tests that read it skip with a reason.
"""

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# CONTRACTS §6 defaults, against an independent float32/float64 reference
ELEMENTWISE_TOL = 2e-3  # one elementwise op
REDUCTION_TOL = 1e-2    # matmul, conv, reductions, softmax
BLOCK_TOL = 2e-2        # a transformer block
LOGITS_TOL = 3e-2       # logits of a whole tiny model
GRAD_TOL = 5e-2         # gradients against PyTorch autograd in fp32 ...
GRAD_COSINE = 0.999     # ... with at least this cosine similarity


TIE_MARGIN = 0.05       # greedy choices may differ where HF's top-2 margin is under this x max|logit|


def decisive(logits) -> bool:
    """CONTRACTS §6's tie rule: HF's top-2 logit margin is at least TIE_MARGIN of max|logit|,
    so a different choice there is a real disagreement."""
    top2 = np.sort(np.asarray(logits, np.float64))[-2:]
    return bool(top2[1] - top2[0] >= TIE_MARGIN * np.abs(logits).max())


def rel_err(got, ref) -> float:
    """CONTRACTS §6: max|got − ref| / max|ref|, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent: ../shared (external fixtures) is not part of a user's clone")
    return p


def rms_norm_graph(b, x, weight, eps: float = 1e-5, name: str = "rms"):
    """x · (Σc x² · 1/C + eps)^-0.5 · w over channels from ANE-safe ops (orion §1.2, maderix §2.3):
    a small realistic graph for the compiler's tests (the kernels' own norm is
    `anelm.kernels.norms`, which first scales x for fp16)."""
    from anelm.ir.graph import Value

    p, c = b.graph.peek_name(name), x.shape[1]
    ss = b.reduce_sum(b.mul(x, x, name=f"{p}_sq"), axes=[1], name=f"{p}_ss")
    ms = b.mul(ss, b.scalar(1.0 / c, x.dtype, f"{p}_invd"), name=f"{p}_ms")
    mse = b.add(ms, b.scalar(eps, x.dtype, f"{p}_eps"), name=f"{p}_mse")
    rrms = b.pow(mse, b.scalar(-0.5, x.dtype, f"{p}_nhalf"), name=f"{p}_rrms")
    if weight is None:
        return b.mul(x, rrms, name=p)
    w = weight if isinstance(weight, Value) else b.weight(f"{p}_w", np.reshape(weight, (1, c, 1, 1)), x.dtype)
    return b.mul(b.mul(x, rrms, name=f"{p}_xr"), w, name=p)
