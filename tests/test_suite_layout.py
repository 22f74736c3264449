"""Any subset of the suite collects: test folders share helpers through tests/helpers.py, never
by importing a `conftest` (which names whichever folder's conftest.py pytest loaded first)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def test_no_test_imports_a_conftest():
    pattern = re.compile(r"^\s*(from\s+conftest\s+import|import\s+conftest\b)", re.M)
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.slow
def test_folders_with_their_own_conftest_collect_together():
    # tests/models has a conftest.py and tests/device's conformance test reads ../shared
    # fixtures through the shared helpers: together they once failed to collect
    files = ["device/test_conformance.py", "models/test_models_tokenizer.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *files], cwd=TESTS, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
