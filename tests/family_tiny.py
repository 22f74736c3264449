"""Tiny models of the families users download (Qwen2, Llama 3.x, Mistral, Phi-3), each as an HF folder
and as the GGUF llama.cpp's converter would write from it (`import family_tiny` from any test
folder): the oracles of tests/generate/test_generate_families.py.

The HF folder is `hf_tiny.make_word_model`'s (a word-level tokenizer whose ids are the model's)
with the head sharpened as docs/testing.md asks. The GGUF holds the same float32 weights under
llama.cpp's names (gguf's own tensor-name map), with what its converter changes: q and k rows
(and their biases) of `llama`-arch models permuted for interleaved RoPE, no output tensor when
the head is tied, Llama 3's per-pair RoPE divisors as the `rope_freqs` tensor, and its metadata
keys (sizes, epsilon, RoPE base and dimension, scaling, window; Phi-3's LongRoPE factors as the
`rope_factors_long`/`_short` tensors, its qkv and gate_up fused as HF has them), plus a byte-level vocabulary of
the same words (no merges: text reaches these models through the folder's tokenizer) with the
family's pre-tokenizer name and a chat template.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hf_tiny

torch, transformers = hf_tiny.torch, hf_tiny.transformers
gguf = pytest.importorskip("gguf")

SHARPEN = 3.0  # the head's scale: greedy choices well separated (docs/testing.md)
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def make(kind: str, folder: Path, seed: int):
    """The HF model of `kind` (hf_tiny.SPECS), sharpened, saved to `folder` with its tokenizer."""
    hf = hf_tiny.make_word_model(folder, seed=seed, kind=kind)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(SHARPEN)  # a tied head: the embedding with it
    hf.save_pretrained(folder)
    return hf.eval()


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's half-split rows of each head [(half, pair)] in the interleaved order [(pair, half)]
    of llama.cpp's RoPE, as its converter stores q and k of `llama`-arch models (biases too)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_divisors(p: dict, hd: int) -> np.ndarray:
    """Llama 3's per-pair divisors of the plain frequencies for HF's rope parameters `p` (with
    rope_theta), by the rule llama.cpp's converter writes its `rope_freqs` tensor with: 1 below
    original/high_freq_factor wavelengths, `factor` above original/low_freq_factor,
    1 / ((1 - s) / factor + s) between."""
    f, lo, hi, old = (p[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    out = []
    for freq in 1.0 / p["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float32) / hd):
        wavelen = 2 * np.pi / float(freq)
        s = (old / wavelen - lo) / (hi - lo)
        out.append(1.0 if wavelen < old / hi else f if wavelen > old / lo else 1 / ((1 - s) / f + s))
    return np.asarray(out, np.float32)


def write_gguf(hf, path: Path, arch: str, pre: str, meta: dict | None = None, permute: bool = False,
               rope_freqs: bool | np.ndarray = False) -> Path:
    """`hf`'s weights and config as llama.cpp's converter lays them out (module doc); `meta`:
    more `{arch}.*` keys (rope scaling, window) by their names after the arch; `rope_freqs`:
    Llama 3's divisors (True: those of `hf`'s parameters) or other values to store instead."""
    c = hf.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    rp = c.rope_parameters
    w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * c.hidden_size) // heads)
    if arch == "phi3":  # Phi3MiniModel: the original context and window (0: none) always, LongRoPE's factors
        old = rp.get("original_max_position_embeddings", c.max_position_embeddings)
        w.add_rope_scaling_orig_ctx_len(old)
        w.add_sliding_window(c.sliding_window or 0)
        if rp.get("long_factor"):
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(c.max_position_embeddings / old) / np.log(old))))
            w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], np.float32))
    if hd != c.hidden_size // heads:
        w.add_key_length(hd)
        w.add_value_length(hd)
    for key, value in (meta or {}).items():
        {int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)](f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(hf_tiny.WORDS)
    w.add_token_types([3, 3, 3] + [1] * (len(hf_tiny.WORDS) - 3))  # control: [UNK], <s>, </s>
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_chat_template(CHAT)
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    names = gguf.get_tensor_name_map(by_name[arch], c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        a = t.detach().numpy().astype(np.float32)
        if permute and ".q_proj." in name:
            a = interleave(a, heads)
        elif permute and ".k_proj." in name:
            a = interleave(a, kv)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), a)
    if rope_freqs is not False:
        own = isinstance(rope_freqs, bool)
        w.add_tensor("rope_freqs.weight", rope_divisors(c.rope_parameters, hd) if own else rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


word_text = hf_tiny.word_text  # the tests that import family_tiny call it from here
