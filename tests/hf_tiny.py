"""Tiny random `transformers` models, saved with `save_pretrained`: the oracles of the model,
generation and CLI tests (`import hf_tiny` from any test folder: tests/ is on pytest's pythonpath).

Weights are redrawn larger than HF's init (std 0.3, norm scales 1 ± 0.1, non-zero biases) so
that every weight matters to the logits and greedy sequences vary instead of repeating one id.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-5, **COMMON)
SPECS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)),
    "llama-mha": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, **LLAMA)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0, **LLAMA)),
    "llama-rope3": ("LlamaConfig", "LlamaForCausalLM",
                    dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                         attention_bias=True, mlp_bias=True, **LLAMA)),
    # Llama 3.2's shape (GQA, a tied head, llama3 rope scaling) at a tiny size: two of the eight
    # frequency pairs in the blend, the rest slowed, past the original context of 16
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500.0,
                    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, **LLAMA)),
    # a window on every layer shorter than the tests' texts, GQA
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=8, rope_theta=1e4, **LLAMA)),
    # RoPE off on the fourth of four layers (NoPE), a tied head
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, pad_token_id=0,
                     **{**LLAMA, "num_hidden_layers": 4})),
    # HF's sliding window on the NoPE layers (off in the released checkpoint)
    "smollm3-window": ("SmolLM3Config", "SmolLM3ForCausalLM",
                       dict(num_attention_heads=4, num_key_value_heads=1, no_rope_layer_interval=2, pad_token_id=0,
                            use_sliding_window=True, sliding_window=8, tie_word_embeddings=False, **LLAMA)),
    # YaRN's attention factor (1.139 on cos and sin) and frequencies past its original context of 16
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                        **LLAMA)),
    # Phi-4-mini's shape: a partial rotation (12 of 16 dims), LongRoPE past an original context of
    # 48 (factor 4/3: attention factor 1.036; generic tests' sequences stay within it, as a cache
    # kept past it is not HF's), GQA, a tied head; the checkpoint fuses qkv and gate_up
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, partial_rotary_factor=0.75,
                  original_max_position_embeddings=48, pad_token_id=0,
                  rope_scaling={"type": "longrope", "short_factor": [1.0, 1.0, 1.25, 1.5, 2.0, 2.5],
                                "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0]}, **LLAMA)),
    # Phi-3-mini's: MHA, a window on every layer, the whole head rotated, an untied head
    "phi3-mini": ("Phi3Config", "Phi3ForCausalLM",
                  dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=8, pad_token_id=0,
                       original_max_position_embeddings=64, **LLAMA)),
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, **LLAMA)),
    "qwen3-untied": ("Qwen3Config", "Qwen3ForCausalLM",
                     dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                          rope_theta=1e6, **LLAMA)),
    # q, k, v biases, a tied head, YaRN as Qwen2.5's long-context variants (HF's 4.x spelling)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e4,
                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, **LLAMA)),
    # HF's sliding window on the layers from max_window_layers on (off in released checkpoints)
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                          use_sliding_window=True, sliding_window=8, max_window_layers=1, **LLAMA)),
    # a window shorter than the tests' texts, local and global RoPE bases of its own, a score
    # scale that is not head_dim's, full attention on the third layer of four
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
                    query_pre_attn_scalar=24, tie_word_embeddings=False, pad_token_id=0,
                    **{**LLAMA, "num_hidden_layers": 4})),
}


def randomize(model, seed: int = 0, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(0.1 * noise if name.endswith("bias") else 1 + 0.1 * noise)
            else:
                p.copy_(std * noise)


def make_hf(kind: str, folder: Path, seed: int = 0):
    """A tiny HF model of `kind`, randomized, saved to `folder`; returns the torch model."""
    cfg_name, model_name, kw = SPECS[kind]
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model


WORDS = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(3, 96)]  # id i is word "w{i}"


def make_word_model(folder: Path, seed: int = 21, kind: str = "llama-gqa"):
    """A tiny HF model of `kind` (a Llama with GQA by default) in `folder` with a word-level
    tokenizer.json whose ids are the model's (`WORDS`); returns the HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = make_hf(kind, folder, seed=seed)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return hf


def word_text(path: Path, n: int, seed: int) -> list[int]:
    """A text of `n` random words in `path`; returns their ids (the word tokenizer's, `WORDS`)."""
    ids = np.random.default_rng(seed).integers(3, len(WORDS), n).tolist()
    path.write_text(" ".join(WORDS[i] for i in ids) + "\n", encoding="utf-8")
    return ids


def word_model_and_text(root: Path, kind: str) -> tuple[Path, Path]:
    """(root/"model", root/"text.txt"): `make_word_model`'s model of `kind` and 300 random words
    to calibrate and score on, as the quantize tests of a family run `anelm quantize` on them."""
    make_word_model(root / "model", kind=kind)
    word_text(root / "text.txt", 300, seed=3)
    return root / "model", root / "text.txt"


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


def hf_windows(model, ids, seq: int) -> tuple[float, list[np.ndarray]]:
    """HF's fixed-window scoring, the oracle of `anelm perplexity`: consecutive windows of `seq`
    ids (a last one under 2 dropped), each from scratch. Returns (mean nll in nats, by torch's
    float64 cross-entropy; each window's logits at every position but its last)."""
    rows, nll, n = [], 0.0, 0
    for w in (list(ids[i:i + seq]) for i in range(0, len(ids), seq)):
        if len(w) < 2:
            continue
        logits = hf_logits(model, w)[:-1]
        nll += float(torch.nn.functional.cross_entropy(torch.from_numpy(logits).double(),
                                                       torch.tensor(w[1:]), reduction="sum"))
        rows.append(logits)
        n += len(w) - 1
    return nll / n, rows



def greedy_against_hf(runner, model, ids, steps: int, prefixes: bool = False) -> tuple[list[int], list[int], list[int]]:
    """`runner`'s greedy tokens from `ids`, judged by HF's `model` run teacher-forced on them (so
    every step is judged on the same prefix): (tokens, the steps where HF's choice is decisive
    by docs/testing.md's tie rule, those of them where ours differs). `prefixes`: HF runs each
    step's prefix alone, as its generation does (LongRoPE's factors depend on the length)."""
    from helpers import decisive

    cache, tokens = runner.new_cache(), []
    logits = runner.prefill(ids, cache, last_only=True)[-1]
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = runner.decode(tokens[-1], cache)
    seq = list(ids) + tokens
    ref = np.stack([hf_logits(model, seq[:n])[-1] for n in range(len(ids), len(seq))]) if prefixes else \
        hf_logits(model, seq)[len(ids) - 1:-1]
    judged = [i for i, theirs in enumerate(ref) if decisive(theirs)]
    return tokens, judged, [i for i in judged if tokens[i] != int(np.argmax(ref[i]))]
