"""kernels/layers.layer_params: `half=True` folds the weights straight to fp16, and gives
exactly what the float32 fold gives after the cast (the programs' blobs do not change)."""

import dataclasses

import numpy as np
import pytest

from anelm.kernels.layers import layer_params, layer_shape
from anelm.fp16.bits import to_half
from anelm.models.config import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen3Config
from anelm.models.names import random_layer

# dim 256: the q, k and v folds have 65,536 elements or more, so the compiled fold runs
CONFIGS = {
    "llama": LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32),
    "qwen3": Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32),
    "gpt2": GPT2Config(n_embd=256, n_layer=1, n_head=4, n_positions=32),  # LayerNorm: shifts fold into biases
    "gemma3_text": Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=64, max_position_embeddings=32, vocab_size=64),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("stream_scale", [1.0, 8.0])
def test_half_params_are_the_float32_params_cast_to_fp16(kind, stream_scale):
    cfg = CONFIGS[kind]
    w = random_layer(cfg, seed=3)
    for k in w:
        if "norm" in k or ".ln" in k or k.startswith("ln"):  # gains away from 1, so the fold matters
            w[k] = (w[k] * 1.5 + 0.1).astype(np.float32)
    s = dataclasses.replace(layer_shape(cfg, 0), stream_scale=stream_scale)
    full, half = layer_params(s, w), layer_params(s, w, half=True)
    assert list(full) == list(half)
    for name, ((fw, fb), (hw, hb)) in ((n, (full[n], half[n])) for n in full):
        if fw.ndim == 2:
            assert hw.dtype == np.float16 and hw.flags.c_contiguous, name
            assert hw.view(np.uint16).tobytes() == to_half(fw).view(np.uint16).tobytes(), name
        else:  # Qwen3's per-head gains stay float32
            assert hw.dtype == fw.dtype and np.array_equal(hw, fw), name
        assert (fb is None) == (hb is None), name
        if fb is not None:
            assert hb.dtype == fb.dtype and np.array_equal(hb, fb), name
    assert full["qkv"][0].shape[0] == s.heads * s.head_dim + 2 * s.kv_channels


def _compiled_layer(cfg, p: dict, seq: int):
    """The layer program `kernels.blocks.decoder_layer` builds, from the params `p` given."""
    from anelm.compiler.pipeline import compile_graph
    from anelm.kernels.layers import rope_full_tables
    from anelm.kernels.prefill import prefill_layer
    from anelm.models.layers import rope_inv_freq, rope_tables

    s = layer_shape(cfg, 0)
    rope = None
    if s.family.rotary:
        inv = rope_inv_freq(cfg.head_dim, *cfg.rope(0))
        rope = rope_full_tables(*rope_tables(np.arange(seq), inv))
    return compile_graph(prefill_layer(s, p, seq, rope, name="layer", kv_outputs=False))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_half_params_are_their_blobs_and_compile_to_the_same_program_byte_for_byte(kind):
    """Each fp16 matrix is the payload of its own BLOBFILE, so the program's blob for it is that
    buffer (no copy); the MIL text and every blob byte equal those of the same layer compiled
    from float32 params and from plain (writable, copied) fp16 arrays, both encoded anew."""
    from anelm.compiler.pipeline import compile_graph
    from anelm.kernels.blocks import decoder_layer

    cfg, seq = CONFIGS[kind], 16
    w = random_layer(cfg, seed=5)
    s = layer_shape(cfg, 0)
    half = layer_params(s, w, half=True)
    matrices = {n: hw for n, (hw, _) in half.items() if hw.ndim == 2}
    assert matrices and all(not m.flags.writeable for m in matrices.values())
    new = _compiled_layer(cfg, half, seq)
    plain = {n: (np.array(hw) if hw.ndim == 2 else hw, hb) for n, (hw, hb) in half.items()}
    olds = (_compiled_layer(cfg, layer_params(s, w), seq), _compiled_layer(cfg, plain, seq),
            compile_graph(decoder_layer(cfg, w, seq)))  # the last: blocks' own layer, folded anew
    for old in olds:
        assert new.mil_text == old.mil_text
        assert list(new.weights) == list(old.weights)
        for path in old.weights:
            assert bytes(new.weights[path]) == bytes(old.weights[path]), path
    views = [b for b in new.weights.values() if isinstance(b, memoryview)]
    assert len(views) == len(matrices)  # every matrix's blob is a view, the small ones are encoded
    for m in matrices.values():
        assert sum(np.shares_memory(np.frombuffer(b, np.uint8), m) for b in views) == 1
