"""Session fixtures for the real pretrained model in ../shared, usable from every test folder
(tests/conftest.py imports them): ours and HF transformers' (the float32 oracle), each loaded
once per session, since reading and dequantizing the GGUF takes seconds on each side.

    smollm_gguf  Path of SmolLM2-135M-Instruct, Q4_1 GGUF (skips when ../shared is absent)
    smollm       (config, float32 weights, tokenizer) from anelm's loader (`load_model`)
    smollm_hf    (torch model in float32, HF tokenizer), both read by transformers from the GGUF
"""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SMOLLM_GGUF = ("data", "models", "smollm2-135m-instruct-q4_1.gguf")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    p = SHARED.joinpath(*SMOLLM_GGUF)
    if not p.is_file():
        pytest.skip(f"{p} is absent: ../shared (external fixtures) is not part of a user's clone")
    return p


@pytest.fixture(scope="session")
def smollm(smollm_gguf):
    from anelm.models.loading import load_model

    return load_model(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_hf(smollm_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    folder, name = str(smollm_gguf.parent), smollm_gguf.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok
