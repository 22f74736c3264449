"""Fixtures and settings for the whole suite. Helpers that tests import live in helpers.py:
a `conftest` module is not importable by name once two folders have one."""

import os
import shutil
import tempfile

import pytest
from real_models import (gemma, gemma_apache, gemma_gguf, gemma_hf, smollm, smollm_gguf,  # noqa: F401  (session
                         smollm_hf)  # fixtures, any folder)


def pytest_configure(config):
    """The suite caches into a temporary folder, never ~/.cache or the package (docs/caching.md).
    Set before any test module imports anelm, which then points numba's cache under it; the
    `python -m anelm` subprocesses of the CLI tests inherit both."""
    os.environ["ANELM_CACHE_DIR"] = tempfile.mkdtemp(prefix="anelm-test-cache-")
    os.environ.pop("NUMBA_CACHE_DIR", None)


def pytest_unconfigure(config):
    shutil.rmtree(os.environ.pop("ANELM_CACHE_DIR"), ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_compile_count():
    """Every test starts as a fresh process would, at zero compiles: the strict budget of 115
    per process is a per-test budget here, so no test fails for what earlier tests compiled."""
    from anelm.device import base

    base.reset_compile_count()
    yield
    base.reset_compile_count()


@pytest.fixture
def cold_compiles(monkeypatch):
    """The emulator's on-disk kernel cache off (ANELM_KERNEL_CACHE_MB=0), for tests about cold
    compiles: with it on, a program an earlier test compiled is loaded, not compiled, and not
    counted against the 115-compile budget."""
    monkeypatch.setenv("ANELM_KERNEL_CACHE_MB", "0")
