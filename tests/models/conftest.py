"""Fixtures of tests/models: the tiny HF models are built once per session."""

import pytest
from hf_tiny import SPECS, make_hf


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """kind -> (folder, HF model)."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: (root / kind, make_hf(kind, root / kind, seed=i)) for i, kind in enumerate(SPECS)}
