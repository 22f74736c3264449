"""Helpers any test folder imports by name (`from helpers import ...`): pyproject puts tests/
on pytest's `pythonpath`, so they import the same way whichever folders a run collects.

`../shared` (beside the repo) holds external fixtures: MIL conformance programs and real
tokenizer files. It is not part of a user's clone, so tests that read it skip with a reason.
"""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent: ../shared (external fixtures) is not part of a user's clone")
    return p
