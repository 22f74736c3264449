"""quant/gptq.py: table indices in GPTQ's order against the nearest entry, on small random linears."""

import numpy as np
import pytest

from anelm.models.formats.quantized import LutQuant
from anelm.quant.gptq import assign
from anelm.quant.lut import kmeans_tables, palettize


def _linear(rng, out=32, inp=96, tokens=512, correlated=True):
    """(w [out, in], inputs x [tokens, in]); correlated: a quarter as many sources as inputs, mixed,
    and a little noise of each input's own."""
    if not correlated:
        return rng.standard_normal((out, inp)).astype(np.float32) * 0.1, rng.standard_normal((tokens, inp))
    z = rng.standard_normal((tokens, inp // 4))
    x = z @ rng.standard_normal((inp // 4, inp)) + 0.1 * rng.standard_normal((tokens, inp))
    return rng.standard_normal((out, inp)).astype(np.float32) * 0.1, x


def test_correlated_inputs_err_less_than_the_nearest_entry():
    """Correlated inputs: GPTQ's indices give the linear's outputs at most 60 % of the nearest
    entries' squared error (measured: 29 % for tables per row and 32 inputs, 13-14 % for tables
    of 8 or 16 rows by 96 inputs, over seeds 0-2)."""
    rng = np.random.default_rng(0)
    w, x = _linear(rng)
    for bits, group, block in ((4, 1, 32), (4, 8, 96), (6, 16, 96)):
        near = palettize(w, bits, group, block, (x ** 2).mean(axis=0))
        q = LutQuant(assign(w, near.lut, x.T @ x), near.lut)
        err = {k: float(((x @ (w - v.dense()).T) ** 2).sum()) for k, v in (("gptq", q), ("nearest", near))}
        assert err["gptq"] < 0.6 * err["nearest"], (bits, group, block, err)
        assert q.indices.dtype == np.uint8 and q.indices.max() < 2 ** bits
        assert np.array_equal(q.lut, near.lut)  # the tables stay the k-means ones, as stored (fp16)
        full = np.repeat(np.repeat(near.lut, group, 0), block, 1).astype(np.float32)  # [out, in, k]
        assert np.array_equal(q.dense(), np.take_along_axis(full, q.indices[..., None].astype(int), 2)[..., 0])


def test_uncorrelated_inputs_take_the_nearest_entry():
    """H diagonal (uncorrelated inputs, a dead one among them): no error moves, every index is
    the nearest entry's, exactly."""
    rng = np.random.default_rng(1)
    w, _ = _linear(rng, correlated=False)
    h = np.diag(rng.uniform(0.1, 4.0, w.shape[1]))
    h[5, 5] = 0.0
    for bits, group, block in ((4, 1, 32), (6, 16, 96)):
        lut = kmeans_tables(w, bits, group, block, np.diagonal(h))
        near = palettize(w, bits, group, block, np.diagonal(h))
        assert np.array_equal(assign(w, lut, h), near.indices)


def test_covariances_in_chunks_are_the_whole_passes(tmp_path, monkeypatch):
    """A tiny Llama, windows of 32 tokens: each layer's H, collected a chunk of layers at a time
    from the stream the previous chunk left, is Σ xᵀx of the inputs one whole pass gives its
    linears; q, k and v share one, gate and up another; one layer a chunk or all at once, the
    same indices."""
    pytest.importorskip("transformers")
    import hf_tiny

    from anelm.models.loading import build_model, load_model
    from anelm.quant import gptq, lut as luts

    hf_tiny.make_word_model(tmp_path / "m")
    config, weights, _ = load_model(tmp_path / "m")
    ids = np.random.default_rng(2).integers(3, 96, 80).tolist()
    model, ref = build_model(config, weights), {}
    plain = model.project

    def project(i, name, x):
        key = f"model.layers.{i}.{name}"
        ref[key] = ref.get(key, 0.0) + np.asarray(x, np.float64).T @ np.asarray(x, np.float64)
        return plain(i, name, x)

    model.project = project
    for s in range(0, len(ids), 32):
        model.prefill(ids[s:s + 32], model.new_cache())
    stream, got, alias = {}, {}, {}
    for layer in range(config.num_hidden_layers):
        acc, more, tokens = gptq.covariances(config, weights, ids, 32, range(layer, layer + 1), stream)
        got.update(acc)
        alias.update(more)
        assert tokens == len(ids)
    assert set(got) | set(alias) == set(ref) and alias["model.layers.1.self_attn.v_proj"].endswith("1.self_attn.q_proj")
    for key, h in ref.items():
        assert np.allclose(got[alias.get(key, key)], h, rtol=1e-4, atol=1e-4 * np.abs(h).max()), key
    specs = [(4, 16, 32), (6, 16, 1 << 30)]
    whole = luts.ordered_tables(config, weights, ids, 32, specs)
    monkeypatch.setattr(gptq, "CHUNK_BYTES", 1)
    for a, b in zip(whole, luts.ordered_tables(config, weights, ids, 32, specs)):
        assert all(np.array_equal(a[n].indices, b[n].indices) and np.array_equal(a[n].lut, b[n].lut) for n in a)
