"""llama2.c checkpoints written here by an independent struct-packing writer of the documented
format (legacy, version 1, version 2 / Q8_0) load and give the logits of the equivalent HF Llama."""

import struct

import numpy as np
import pytest
from hf_tiny import hf_logits, randomize, torch, transformers
from helpers import rel_err

from anelm.models.errors import LoadError
from anelm.models.loading import build_model, load_model
from anelm.models.tokenizer.sentencepiece import Llama2cTokenizer

SEQ_LEN = 64


def hf_llama(tied: bool, seed: int):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed)
    return model


def to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rows of a head are (all x_i, then all y_i); llama2.c's are pairs (x_0, y_0, x_1, y_1...)."""
    hd = w.shape[0] // heads
    rows = [h * hd + part * (hd // 2) + j for h in range(heads) for j in range(hd // 2) for part in (0, 1)]
    return w[rows]


def tensors(model) -> dict:
    """llama2.c's tensor groups, each a list over layers (q/k in llama2.c's row order)."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    c = model.config
    per = lambda name: [sd[f"model.layers.{i}.{name}"] for i in range(c.num_hidden_layers)]  # noqa: E731
    return dict(
        tok=[sd["model.embed_tokens.weight"]], att=per("input_layernorm.weight"),
        wq=[to_interleaved(w, c.num_attention_heads) for w in per("self_attn.q_proj.weight")],
        wk=[to_interleaved(w, c.num_key_value_heads) for w in per("self_attn.k_proj.weight")],
        wv=per("self_attn.v_proj.weight"), wo=per("self_attn.o_proj.weight"),
        ffn=per("post_attention_layernorm.weight"),
        w1=per("mlp.gate_proj.weight"), w2=per("mlp.down_proj.weight"), w3=per("mlp.up_proj.weight"),
        final=[sd["model.norm.weight"]], cls=[] if c.tie_word_embeddings else [sd["lm_head.weight"]])


def dims(model) -> list[int]:
    c = model.config
    return [c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, SEQ_LEN]


def write_legacy(path, model) -> None:
    t, d = tensors(model), dims(model)
    if t["cls"]:
        d[5] = -d[5]  # negative vocab: the classifier follows
    hd2 = model.config.hidden_size // model.config.num_attention_heads // 2
    rope = [np.ones((SEQ_LEN, hd2), np.float32), np.zeros((SEQ_LEN, hd2), np.float32)]
    order = ["tok", "att", "wq", "wk", "wv", "wo", "ffn", "w1", "w2", "w3", "final"]
    body = b"".join(a.tobytes() for k in order for a in t[k]) + b"".join(a.tobytes() for a in rope + t["cls"])
    path.write_bytes(struct.pack("<7i", *d) + body)


def header(version: int, model, shared: bool, extra: bytes = b"") -> bytes:
    h = struct.pack("<Ii", 0x616B3432, version) + struct.pack("<7i", *dims(model)) + struct.pack("<B", shared) + extra
    return h + b"\0" * (256 - len(h))


def write_v1(path, model) -> None:
    t = tensors(model)
    order = ["att", "ffn", "final", "tok", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "cls"]
    path.write_bytes(header(1, model, not t["cls"]) + b"".join(a.tobytes() for k in order for a in t[k]))


def q80(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    g = w.reshape(-1, group)
    scale = (np.abs(g).max(axis=1) / 127.0).astype(np.float32)
    return np.round(g / scale[:, None]).astype(np.int8), scale


def write_v2(path, model, group: int = 32) -> None:
    """Norms fp32; every matrix Q8_0. The HF model gets the dequantized weights, so both agree."""
    t = tensors(model)
    parts = [header(2, model, not t["cls"], struct.pack("<i", group))]
    parts += [a.tobytes() for k in ("att", "ffn", "final") for a in t[k]]
    for k in ("tok", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "cls"):
        for a in t[k]:
            q, s = q80(a, group)
            parts += [q.tobytes(), s.tobytes()]
    path.write_bytes(b"".join(parts))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                q, s = q80(p.numpy().astype(np.float32), group)
                p.copy_(torch.from_numpy((q * s[:, None]).reshape(p.shape)))


@pytest.mark.parametrize("writer", [write_legacy, write_v1, write_v2])
@pytest.mark.parametrize("tied", [True, False])
def test_llama2c_checkpoint_gives_hf_logits(tmp_path, writer, tied):
    model = hf_llama(tied, seed=3 + tied)
    writer(tmp_path / "model.bin", model)
    config, weights, tok = load_model(tmp_path / "model.bin")
    assert (config.tie_word_embeddings, config.num_key_value_heads, tok) == (tied, 2, None)
    ids = np.random.default_rng(0).integers(0, 96, 40).tolist()
    assert rel_err(build_model(config, weights).forward(ids), hf_logits(model, ids)) < 1e-4


def test_tokenizer_bin_beside_the_checkpoint_is_found(tmp_path):
    write_v1(tmp_path / "model.bin", hf_llama(True, seed=5))
    pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += ["▁a".encode(), b"a", "▁".encode()]
    body = b"".join(struct.pack("<fi", -float(i), len(p)) + p for i, p in enumerate(pieces))
    (tmp_path / "tokenizer.bin").write_bytes(struct.pack("<I", 4) + body)
    _, _, tok = load_model(tmp_path / "model.bin")
    assert isinstance(tok, Llama2cTokenizer) and tok.encode("a") == [1, 259]


def test_truncated_and_unknown_versions_are_one_line_errors(tmp_path):
    good = tmp_path / "good.bin"
    write_v1(good, hf_llama(False, seed=6))
    data = good.read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:-100])
    with pytest.raises(LoadError, match=r"truncated llama2.c checkpoint: expected \d+ bytes, found \d+"):
        load_model(cut)
    cut.write_bytes(data[:100])
    with pytest.raises(LoadError, match="truncated llama2.c header"):
        load_model(cut)
    bad = tmp_path / "v9.bin"
    bad.write_bytes(data[:4] + struct.pack("<i", 9) + data[8:])
    with pytest.raises(LoadError, match="unsupported llama2.c version 9"):
        load_model(bad)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(struct.pack("<7i", 30, 64, 2, 4, 4, 96, 64))  # dim 30 is not a multiple of 4 heads
    with pytest.raises(LoadError, match="must be a positive multiple of n_heads"):
        load_model(junk)
