"""llama2.c checkpoints (`.bin`) → a `LlamaConfig` and HF-named float32 weights.

The file format is the contract (karpathy/llama2.c `export.py` / `run.c`), little-endian:
- legacy: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a
  negative vocab_size means the classifier is not shared), then fp32 tensors: embedding,
  per-type stacks over layers (rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3), rms_final, the
  RoPE tables freq_cis_real/imag [seq_len, head_dim/2], then wcls when not shared;
- version 1: uint32 magic "ak42", int32 version, the 7 ints, a uint8 shared-classifier flag,
  zero padding to 256 bytes; fp32 norms first (rms_att, rms_ffn, rms_final), then the
  embedding, wq, wk, wv, wo, w1, w2, w3 stacks, then wcls when not shared;
- version 2: as version 1 plus an int32 group size after the flag; the norms stay fp32 and
  every matrix is Q8_0: int8 values, then one fp32 scale per group.
llama2.c rotates adjacent pairs (2i, 2i+1) in RoPE where HF rotates (i, i + hd/2): the q/k rows
are permuted on load exactly as HF's converter does, so the model runs with HF's RoPE.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..config import LlamaConfig
from ..errors import ConfigError, LoadError

MAGIC = 0x616B3432  # b"24ka" on disk: "ak42" as a little-endian uint32
HEADER_BYTES = 256  # versioned files pad their header to this
LEGACY_HEADER = struct.Struct("<7i")


def read_llama2c(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    path = Path(path)
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    version, dims, shared, group, offset = _header(data, path)
    config = _config(dims, shared, path)
    layout = _layout(version, config)
    odd = next((n for n, shape, kind in layout if kind == "q8" and int(np.prod(shape)) % group), None)
    if odd:
        raise LoadError(f"{path}: llama2.c group size {group} does not divide the size of {odd}")
    need = offset + sum(_nbytes(shape, kind, group) for _, shape, kind in layout)
    if data.size < need:
        raise LoadError(f"{path}: truncated llama2.c checkpoint: expected {need} bytes, found {data.size}")
    weights = {}
    for name, shape, kind in layout:
        weights[name] = _read(data, offset, shape, kind, group)
        offset += _nbytes(shape, kind, group)
    return config, _to_hf(weights, config)


def _header(data: np.ndarray, path: Path) -> tuple[int, tuple[int, ...], bool, int, int]:
    """(version, 7 dims, shared classifier, Q8 group size, offset of the first tensor)."""
    if data.size < 4 or int.from_bytes(data[:4].tobytes(), "little") != MAGIC:
        if data.size < LEGACY_HEADER.size:
            raise LoadError(f"{path}: truncated llama2.c header: expected {LEGACY_HEADER.size} bytes, "
                            f"found {data.size}")
        dims = LEGACY_HEADER.unpack(data[:LEGACY_HEADER.size].tobytes())
        shared = dims[5] > 0  # legacy files say "classifier not shared" with a negative vocab
        return 0, dims[:5] + (abs(dims[5]),) + dims[6:], shared, 0, LEGACY_HEADER.size
    if data.size < HEADER_BYTES:
        raise LoadError(f"{path}: truncated llama2.c header: expected {HEADER_BYTES} bytes, found {data.size}")
    head = data[:HEADER_BYTES].tobytes()
    version = struct.unpack_from("<i", head, 4)[0]
    if version not in (1, 2):
        raise LoadError(f"{path}: unsupported llama2.c version {version}: expected 1, 2 or the legacy header")
    dims = struct.unpack_from("<7i", head, 8)
    shared = bool(head[36])
    group = struct.unpack_from("<i", head, 37)[0] if version == 2 else 0
    if version == 2 and group <= 0:
        raise LoadError(f"{path}: llama2.c version 2 group size must be positive, got {group}")
    return version, dims, shared, group, HEADER_BYTES


def _config(dims: tuple[int, ...], shared: bool, path: Path) -> LlamaConfig:
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = dims
    try:
        if n_heads <= 0 or dim % n_heads:
            raise ConfigError(f"dim ({dim}) must be a positive multiple of n_heads ({n_heads})")
        # llama2.c's fixed choices: RMSNorm eps 1e-5, RoPE base 10000, BOS 1, EOS 2.
        return LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
                           num_hidden_layers=n_layers, num_attention_heads=n_heads,
                           num_key_value_heads=n_kv, max_position_embeddings=seq_len,
                           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=shared,
                           bos_token_id=1, eos_token_id=2)
    except ConfigError as e:
        raise LoadError(f"{path}: not a llama2.c checkpoint we can run: {e}") from None


def _layout(version: int, c: LlamaConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, kind) in file order; kind "f32", "q8" or "skip" (unused RoPE tables)."""
    d, f, v, kv = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_key_value_heads * c.head_dim

    def stack(suffix: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"model.layers.{i}.{suffix}", shape) for i in range(c.num_hidden_layers)]

    att, ffn = stack("input_layernorm.weight", (d,)), stack("post_attention_layernorm.weight", (d,))
    wq, wk = stack("self_attn.q_proj.weight", (d, d)), stack("self_attn.k_proj.weight", (kv, d))
    wv, wo = stack("self_attn.v_proj.weight", (kv, d)), stack("self_attn.o_proj.weight", (d, d))
    w1, w2 = stack("mlp.gate_proj.weight", (f, d)), stack("mlp.down_proj.weight", (d, f))
    w3 = stack("mlp.up_proj.weight", (f, d))
    emb, final = [("model.embed_tokens.weight", (v, d))], [("model.norm.weight", (d,))]
    cls = [] if c.tie_word_embeddings else [("lm_head.weight", (v, d))]
    if version == 0:
        rope = [("freq_cis_real", (c.max_position_embeddings, c.head_dim // 2)),
                ("freq_cis_imag", (c.max_position_embeddings, c.head_dim // 2))]
        items = emb + att + wq + wk + wv + wo + ffn + w1 + w2 + w3 + final
        return [(n, s, "f32") for n, s in items] + [(n, s, "skip") for n, s in rope] + [(n, s, "f32") for n, s in cls]
    norms = [(n, s, "f32") for n, s in att + ffn + final]
    kind = "q8" if version == 2 else "f32"
    return norms + [(n, s, kind) for n, s in emb + wq + wk + wv + wo + w1 + w2 + w3 + cls]


def _nbytes(shape: tuple[int, ...], kind: str, group: int) -> int:
    n = int(np.prod(shape))
    return n + 4 * (n // group) if kind == "q8" else 4 * n


def _read(data: np.ndarray, offset: int, shape: tuple[int, ...], kind: str, group: int) -> np.ndarray:
    n = int(np.prod(shape))
    if kind != "q8":
        return np.frombuffer(data, np.float32, n, offset).reshape(shape)
    q = np.frombuffer(data, np.int8, n, offset).reshape(-1, group)  # [n/group, group]
    s = np.frombuffer(data, np.float32, n // group, offset + n)
    return (q * s[:, None]).astype(np.float32).reshape(shape)


def _to_hf(w: dict[str, np.ndarray], c: LlamaConfig) -> dict[str, np.ndarray]:
    return qk_interleaved_to_half({k: v for k, v in w.items() if not k.startswith("freq_cis")}, c)


def qk_interleaved_to_half(w: dict[str, np.ndarray], c: LlamaConfig) -> dict[str, np.ndarray]:
    """Every layer's q/k rows from interleaved RoPE pairs to HF's halves, in place. llama2.c
    and llama.cpp's llama-arch converter both store the interleaved order."""
    for i in range(c.num_hidden_layers):
        for n, heads in (("q_proj", c.num_attention_heads), ("k_proj", c.num_key_value_heads)):
            p = f"model.layers.{i}.self_attn.{n}."
            w[p + "weight"] = _interleaved_to_half(w[p + "weight"], heads)
            if p + "bias" in w:  # llama.cpp permutes a bias's rows with its weight's
                w[p + "bias"] = _interleaved_to_half(w[p + "bias"][:, None], heads)[:, 0]
    return w


def _interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head ordered (pair j, element e) -> (element e, pair j), as HF's converter."""
    out, d = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, d).transpose(0, 2, 1, 3).reshape(out, d)  # [H, 2, hd/2, D]
