"""Fixtures and settings for the whole suite. Helpers that tests import live in helpers.py:
a `conftest` module is not importable by name once two folders have one."""

import pytest


@pytest.fixture(autouse=True)
def fresh_compile_count():
    """Every test starts as a fresh process would, at zero compiles: the strict budget of 119
    per process is a per-test budget here, so no test fails for what earlier tests compiled."""
    from anelm.device import base

    base.reset_compile_count()
    yield
    base.reset_compile_count()
