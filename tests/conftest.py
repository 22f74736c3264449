"""Shared test fixtures.

`../shared` (beside the repo) holds external fixtures: MIL conformance programs and real
tokenizer files. It is not part of a user's clone, so tests that read it skip with a reason.
"""

from pathlib import Path

import pytest
from real_models import smollm, smollm_gguf, smollm_hf  # noqa: F401  (session fixtures, any folder)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent: ../shared (external fixtures) is not part of a user's clone")
    return p


@pytest.fixture(autouse=True)
def fresh_compile_count():
    """Every test starts as a fresh process would, at zero compiles: the strict budget of 119
    per process is a per-test budget here, so no test fails for what earlier tests compiled."""
    from anelm.device import base

    base.reset_compile_count()
    yield
    base.reset_compile_count()
