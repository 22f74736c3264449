"""GGUF models against HF transformers reading the same file (float32 both).

The real SmolLM2-135M Q4_1 file (session fixtures of tests/real_models.py): every dequantized
tensor, prompt ids, chat-template ids, CPU logits, and `anelm export`. Tiny random GGUFs written
with `gguf.GGUFWriter` cover the other architectures (gpt2, qwen3, llama with a SentencePiece
vocabulary) and the errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_tiny import hf_logits, torch, transformers
from helpers import rel_err, shared_path

from anelm.cli.main import main
from anelm.models.loading import build_model, load_model

gguf = pytest.importorskip("gguf")

TOL = 1e-4  # float32 against float32 on the same weights: only summation order differs
PROMPTS = ["Hello world", "  two leading spaces, then\ttabs", "Numbers: 12345, 3.14159 and 2024-06-01.",
           "unicode: héllo wörld, 日本語, emoji 🙂🚀", "line one\nline two\n\n  indented", "x"]
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
SENTENCE = "The quick brown fox jumps over the lazy dog. In 1969, astronauts"


def hf_chat_ids(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# --- the real model ---------------------------------------------------------------------------

def test_every_dequantized_tensor_equals_hf(smollm, smollm_hf):
    config, weights, _ = smollm
    theirs = {k: v.numpy() for k, v in smollm_hf[0].state_dict().items()}
    assert config.tie_word_embeddings and "lm_head.weight" not in weights  # HF ties it to the embedding
    assert set(theirs) - {"lm_head.weight"} == set(weights)
    worst = max(float(np.max(np.abs(weights[k] - theirs[k]))) for k in weights)
    assert worst == 0.0, f"largest difference {worst}"  # both run gguf's dequantizers; q/k unpermuted alike


def test_config_matches_hf(smollm, smollm_hf):
    ours, hf = smollm[0], smollm_hf[0].config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("text", PROMPTS)
def test_prompt_ids_equal_hf(smollm, smollm_hf, text):
    ours, theirs = smollm[2], smollm_hf[1]
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text


def test_chat_template_ids_equal_hf(smollm, smollm_hf):
    ours, theirs = smollm[2], smollm_hf[1]
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    for messages in (CHAT[1:2], CHAT):
        assert ours.apply_chat_template(messages) == hf_chat_ids(theirs, messages)


def test_cpu_logits_match_hf(smollm, smollm_hf):
    config, weights, tok = smollm
    ids = tok.encode(SENTENCE)
    ours = build_model(config, weights).forward(ids)
    theirs = hf_logits(smollm_hf[0], ids)
    assert rel_err(ours, theirs) < TOL
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_export_gives_a_folder_transformers_loads(smollm_gguf, smollm, smollm_hf, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(smollm_gguf), "--out", str(out)]) == 0
    assert capsys.readouterr().err.startswith("anelm: exported ")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = smollm[2].encode(SENTENCE)
    assert rel_err(hf_logits(hf, ids), hf_logits(smollm_hf[0], ids)) < 1e-6  # the same float32 weights
    assert [tok(t)["input_ids"] for t in PROMPTS] == [smollm_hf[1](t)["input_ids"] for t in PROMPTS]
    assert hf_chat_ids(tok, CHAT) == hf_chat_ids(smollm_hf[1], CHAT)


# --- tiny random GGUFs ------------------------------------------------------------------------

GPT2_MERGES = 2000  # a small vocabulary keeps the tiny files quick to read on both sides


def gpt2_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's 256 byte symbols and its first merges: GPT-2 numbers merge i's result 256 + i, so
    its first 256 + n tokens are closed under its first n merges. <|endoftext|> ends the list."""
    vocab_file = shared_path("data", "tokenizers", "gpt2-vocab.json")
    vocab = json.loads(vocab_file.read_text())
    merges = [m for m in (vocab_file.parent / "gpt2-merges.txt").read_text().splitlines()[1:] if m]
    return sorted(vocab, key=vocab.get)[:256 + GPT2_MERGES] + ["<|endoftext|>"], merges[:GPT2_MERGES]


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int], object]:
    spm = pytest.importorskip("sentencepiece")
    f = shared_path("data", "tokenizers", "llama2-tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(f))
    n = sp.vocab_size()
    # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    return [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], types, sp


# Quantization types the tiny models spread over their matrices (rows are multiples of 32).
QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"]


def write_gguf(path, arch: str, meta: dict, tensors: dict[str, np.ndarray], as_numpy: dict | None = None) -> None:
    """`tensors` in numpy (llama.cpp) layout; 2-D ones are stored in turn in each of QTYPES, and
    those named in `as_numpy` as that numpy dtype (int32 is GGML's I32)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string,
         list: w.add_array}[type(value)](key, value)
    for i, (name, t) in enumerate(tensors.items()):
        if name in (as_numpy or {}):
            w.add_tensor(name, t.astype(as_numpy[name]))
            continue
        qtype = gguf.GGMLQuantizationType[QTYPES[i % len(QTYPES)]] if t.ndim == 2 else gguf.GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(t.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_tensors(arch: str, vocab: int, d: int, f: int, layers: int, q: int, kv: int, tied: bool, hd: int = 0):
    rng = np.random.default_rng(0)
    mat = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    vec = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    t = {"token_embd.weight": mat(vocab, d)}
    if arch == "gpt2":
        t["position_embd.weight"] = mat(1024, d)
    for i in range(layers):
        b = f"blk.{i}."
        if arch == "gpt2":
            t.update({b + "attn_norm.weight": vec(d), b + "attn_norm.bias": vec(d) - 1,
                      b + "attn_qkv.weight": mat(3 * d, d), b + "attn_qkv.bias": vec(3 * d) - 1,
                      b + "attn_output.weight": mat(d, d), b + "attn_output.bias": vec(d) - 1,
                      b + "ffn_norm.weight": vec(d), b + "ffn_norm.bias": vec(d) - 1,
                      b + "ffn_up.weight": mat(f, d), b + "ffn_up.bias": vec(f) - 1,
                      b + "ffn_down.weight": mat(d, f), b + "ffn_down.bias": vec(d) - 1})
            continue
        t.update({b + "attn_norm.weight": vec(d), b + "attn_q.weight": mat(q * hd, d),
                  b + "attn_k.weight": mat(kv * hd, d), b + "attn_v.weight": mat(kv * hd, d),
                  b + "attn_output.weight": mat(d, q * hd), b + "ffn_norm.weight": vec(d),
                  b + "ffn_gate.weight": mat(f, d), b + "ffn_up.weight": mat(f, d), b + "ffn_down.weight": mat(d, f)})
        if arch == "qwen3":
            t.update({b + "attn_q_norm.weight": vec(hd), b + "attn_k_norm.weight": vec(hd)})
    t["output_norm.weight"] = vec(d)
    if arch == "gpt2":
        t["output_norm.bias"] = vec(d) - 1
    if not tied:
        t["output.weight"] = mat(vocab, d)
    return t


def tiny_gguf(tmp_path, kind: str, as_numpy: dict | None = None):
    """(path, tokenizer oracle or None) of a tiny random model of `kind`."""
    d, f, layers = 64, 256, 2
    if kind == "llama-spm":
        tokens, scores, types, sp = sentencepiece_vocab()
        tok = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
               "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
               "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
        arch, heads, kv, hd, tied, extra = "llama", 4, 2, 16, False, {}
    else:
        tokens, merges = gpt2_vocab()
        sp = None
        tok = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
               "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
               "tokenizer.ggml.bos_token_id": len(tokens) - 1, "tokenizer.ggml.eos_token_id": len(tokens) - 1, "tokenizer.ggml.pre": "gpt-2" if kind == "gpt2" else "qwen2"}
        # HF reads no head_dim for qwen3 from a GGUF: its default, 128, is what the file must hold.
        arch, heads, kv, hd, tied = ("gpt2", 4, 4, 16, True) if kind == "gpt2" else ("qwen3", 2, 1, 128, False)
        extra = {"gpt2": {"attention.layer_norm_epsilon": 1e-5},
                 "qwen3": {"attention.key_length": hd, "attention.value_length": hd}}[arch]
    meta = {"block_count": layers, "context_length": 1024, "embedding_length": d, "feed_forward_length": f,
            "attention.head_count": heads, **extra}
    if arch != "gpt2":
        meta.update({"attention.head_count_kv": kv, "attention.layer_norm_rms_epsilon": 1e-5,
                     "rope.freq_base": 10000.0, "rope.dimension_count": hd})
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, arch, {**{f"{arch}.{k}": v for k, v in meta.items()}, **tok},
               tiny_tensors(arch, len(tokens), d, f, layers, heads, kv, tied, hd), as_numpy)
    return path, sp


TINY = ["gpt2", "qwen3", "llama-spm"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (GGUF path, SentencePiece oracle or None, our (config, weights, tokenizer),
    HF model, HF tokenizer), each read once."""
    out = {}
    for kind in TINY:
        folder = tmp_path_factory.mktemp(kind)
        path, sp = tiny_gguf(folder, kind)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
        out[kind] = (path, sp, load_model(path), hf.eval(),
                     transformers.AutoTokenizer.from_pretrained(folder, gguf_file=path.name))
    return out


@pytest.mark.parametrize("kind", TINY)
def test_tiny_architectures_match_hf(tiny, kind):
    path, sp, (config, weights, tok), hf, hf_tok = tiny[kind]
    assert config.model_type == kind.split("-")[0]
    ids = tok.encode(SENTENCE)
    assert rel_err(build_model(config, weights).forward(ids), hf_logits(hf, ids)) < TOL
    for text in PROMPTS:
        theirs = hf_tok(text)["input_ids"]
        if sp is not None:  # SentencePiece itself, and BOS as llama.cpp adds it
            assert tok.encode(text) == [1] + sp.encode(text), text
            # HF's GGUF converter adds no "▁" to text that starts with a space (SentencePiece
            # and llama.cpp do): it is the oracle only where it agrees with SentencePiece.
            if theirs != [1] + sp.encode(text):
                continue
        assert tok.encode(text) == theirs, text


def test_tiny_export_loads_in_transformers(tiny, tmp_path):
    path, _, _, theirs, _ = tiny["gpt2"]  # GPT-2's Conv1D weights go back to [in, out]
    assert main(["export", str(path), "--out", str(tmp_path / "hf")]) == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = list(range(5, 40))
    assert rel_err(hf_logits(ours, ids), hf_logits(theirs, ids)) < 1e-6


# --- errors -----------------------------------------------------------------------------------

def one_line_error(capsys, *argv) -> str:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.startswith("anelm: error: "), err
    return err


def minimal_gguf(path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_is_one_line_error(tmp_path, capsys):
    minimal_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    err = one_line_error(capsys, "generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "hi")
    assert "unsupported GGUF architecture 'mamba'" in err


def test_unknown_tensor_type_is_one_line_error(tmp_path, capsys):
    path = tmp_path / "odd.gguf"
    minimal_gguf(path, "llama", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    data = bytearray(path.read_bytes())
    # tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64); F32 is type 0
    at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 2 * 8
    assert data[at:at + 4] == (0).to_bytes(4, "little")
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    err = one_line_error(capsys, "export", str(path), "--out", str(tmp_path / "out"))
    assert "unknown GGUF tensor type 99" in err


@pytest.mark.parametrize("keep", [0.5, 1000, 10])
def test_a_truncated_gguf_says_so(smollm_gguf, tmp_path, capsys, keep):
    """An interrupted download: the file ends inside its tensors, its metadata or its header."""
    data = smollm_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    err = one_line_error(capsys, "generate", "--model", str(path), "--prompt", "hi")
    assert "not a readable GGUF file (truncated:" in err or (keep == 10 and "not a readable GGUF file" in err), err


def test_a_type_gguf_cannot_dequantize_is_one_line_error(tmp_path, capsys):
    path, _ = tiny_gguf(tmp_path, "gpt2", as_numpy={"output_norm.weight": np.int32})
    err = one_line_error(capsys, "generate", "--model", str(path), "--prompt", "hi")
    assert "output_norm.weight has type I32" in err


def test_train_init_from_reads_a_gguf(tiny):
    from anelm.train.init import load_pretrained

    path, _, (config, weights, _), _, _ = tiny["llama-spm"]
    cfg, init, tok = load_pretrained(path)
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == config.num_key_value_heads
    assert set(init) == set(weights) and all(np.array_equal(init[k], weights[k]) for k in weights)
    assert tok is not None and tok.encode("hi") == [1] + tiny["llama-spm"][1].encode("hi")


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "smollm", "default", "gpt-4o"])
def test_byte_level_pre_tokenizers(tmp_path, pre):
    """Each family's split against HF's GGUF tokenizer where HF has the same regex; every
    family round-trips. (HF splits smollm and default files as GPT-2 does; llama.cpp splits
    smollm's digits apart, and default's into threes and its punctuation runs apart.)"""
    from anelm.models.tokenizer.gguf import tokenizer_from_gguf

    tokens, merges = gpt2_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
            "tokenizer.ggml.bos_token_id": len(tokens) - 1, "tokenizer.ggml.eos_token_id": len(tokens) - 1}
    ours = tokenizer_from_gguf(meta, "test")
    texts = PROMPTS + ["it's 1234567 o'clock!!! ... done", "A\r\n\r\nB   C"]
    assert all(ours.decode(ours.encode(t)) == t for t in texts)
    if pre == "smollm":
        assert ours.encode("1234") == [ours.tok.token_to_id(c) for c in "1234"]  # digits apart
    if pre == "default":  # digits in groups of three
        assert ours.encode("1234567") == ours.encode("123") + ours.encode("456") + ours.encode("7")
    if pre == "gpt-4o":  # o200k's split, as tiktoken documents it: a capital starts a word, digits in threes
        words = [w for w, _ in ours.tok.pre_tokenizer.pre_tokenize_str("HelloWorld's 12345 iPhone\nDONE.\r\n")]
        assert words == ["Hello", "World's", "Ġ", "123", "45", "Ġi", "Phone", "Ċ", "DONE", ".čĊ"]
    if pre in ("smollm", "default", "gpt-4o"):  # HF's GGUF reader does not split these as llama.cpp does
        return
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for k, v in meta.items():
        (w.add_string if isinstance(v, str) else w.add_uint32 if isinstance(v, int) else w.add_array)(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    assert [ours.encode(t) for t in texts] == [theirs(t)["input_ids"] for t in texts]
