"""A kernel-cache hit (device/emulator_cache.py) replays the very plan a cold compile builds.

Oracle: the plan of the cold compile, in the same process. The warm compile is made in a fresh
device with parsing and building forbidden, so only the stored entry and the caller's blobs can
give its plan. Both plans are run on the same inputs, whole (`Plan.run`) and, for decode's
column-separable kernels, column by column (`ColumnPlan.run`), with and without the overflow
watch: every output must be the same bytes and the first overflowing op the same (CONTRACTS §8; weights scaled up so that
some op overflows, and plain ones where none does). The replayed plan's structure
(steps, frees, consts, column axes) is compared too, as the entry now keeps what the build
derived instead of deriving it again. An entry of an older layout under the current format
number, or one that names a class, is a miss, compiled cold and rewritten.
"""

import io
import pickle

import numpy as np
import pytest

from anelm.compiler.pipeline import compile_graph
from anelm.device import base, emulator_builder
from anelm.device.emulator import Emulator
from anelm.device.emulator_cache import _Unpickler, kernel_store
from anelm.device.emulator_columns import column_axes
from anelm.kernels.decode import decode_layer
from anelm.kernels.int8 import qlinear
from anelm.kernels.layers import layer_params, layer_shape
from anelm.kernels.prefill import prefill_layer
from anelm.mil import parser as mil_parser
from anelm.models.names import random_layer
from anelm.models.quantized import InputQuant
from test_emulator_columns import CONFIGS, PROFILE, W, _inputs

WEIGHT_SCALES = {"plain": 1.0, "overflowing": 16.0}  # x16 weights: attention scores or an MLP product pass 65504


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Each test starts with an empty kernel cache of its own."""
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)


def _layer(kind: str, factor: float, int8: bool = False):
    s = layer_shape(CONFIGS[kind], 0)
    p = layer_params(s, {k: v * factor for k, v in random_layer(CONFIGS[kind], seed=5).items()})
    if int8:  # the int8 linears of a quantized folder, biases kept in fp16
        p = {n: (qlinear(w, InputQuant()), b) if w.ndim == 2 else (w, b) for n, (w, b) in p.items()}
    return s, p


def _prefill(kind: str, factor: float):
    return prefill_layer(*_layer(kind, factor), 2 * W)


def _decode(kind: str, factor: float, int8: bool = False):
    s, p = _layer(kind, factor, int8)
    return decode_layer(s, p, 64, rope=s.family.rotary, name=f"decode_{kind}", columns=W)


PROGRAMS = {f"prefill-{k}": (lambda f, k=k: _prefill(k, f)) for k in CONFIGS}
PROGRAMS.update({f"decode-{k}": (lambda f, k=k: _decode(k, f)) for k in CONFIGS})
PROGRAMS["decode-llama-int8"] = lambda f: _decode("llama-gqa", f, int8=True)


def cold_and_warm(graph, monkeypatch):
    """(cold model, warm model) of one program: built, then loaded from the entry it left."""
    art = compile_graph(graph, PROFILE)
    before = base.compile_count()
    cold = Emulator(PROFILE).compile(art.mil_text, art.weights)
    assert base.compile_count() == before + 1 and kernel_store().get(art.key(PROFILE)) is not None
    return cold, warm_compile(art, monkeypatch)


def warm_compile(art, monkeypatch):
    """The program of `art` from its kernel-cache entry, parsing and building forbidden."""
    before = base.compile_count()

    def refuse(*a, **k):
        raise AssertionError("a cache hit parsed or built its plan")
    with monkeypatch.context() as m:
        m.setattr(mil_parser, "parse", refuse)
        m.setattr(emulator_builder._Builder, "build", refuse)
        warm = Emulator(PROFILE).compile(art.mil_text, art.weights)
    assert base.compile_count() == before and warm.func is None  # loaded, not compiled
    return warm


def runs(model, x, watch: bool):
    """{way: (outputs, overflow found)} for the whole plan and, when separable, by columns."""
    out = {}
    found = [] if watch else None
    out["whole"] = (model.plan.run(x, overflow=found), found)
    if model.columns is not None:
        found = [] if watch else None
        out["columns"] = (model.columns.run(x, set(), None, model.plan, overflow=found), found)
    return out


def structure(model):
    p = model.plan
    steps = [(s.node, s.op, s.tensors, s.params, [n for n, _ in s.outs], s.free) for s in p.steps]
    consts = {k: (v if isinstance(v, str) else (v.dtype.str, v.shape, v.tobytes())) for k, v in p.consts.items()}
    return p.inputs, p.outputs, steps, consts, column_axes(p)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("weights", sorted(WEIGHT_SCALES))
def test_a_replayed_plan_runs_bit_for_bit_the_built_one(name, weights, monkeypatch):
    cold, warm = cold_and_warm(PROGRAMS[name](WEIGHT_SCALES[weights]), monkeypatch)
    assert structure(warm) == structure(cold)
    assert (warm.columns is None) == (cold.columns is None) == name.startswith("prefill")
    x = _inputs(cold, np.random.default_rng(1))
    for watch in (False, True):
        want, got = runs(cold, x, watch), runs(warm, x, watch)
        assert sorted(got) == sorted(want)
        for way, (ref, ref_found) in want.items():
            res, found = got[way]
            assert sorted(res) == sorted(ref)
            for k in ref:
                assert res[k].dtype == ref[k].dtype and res[k].tobytes() == ref[k].tobytes(), (way, k)
            assert found == ref_found, way
            if watch:  # the watch has something to find exactly when the weights are heavy
                assert bool(found) == (weights == "overflowing"), (way, found)


def test_the_entry_keeps_the_column_axes_the_plan_has(monkeypatch):
    cold, warm = cold_and_warm(_decode("gpt2", 1.0), monkeypatch)
    payload = kernel_store().get(cold.key)
    stored = _Unpickler(io.BytesIO(payload)).load()[3]  # (inputs, outputs, record, axes, finished)
    assert stored == column_axes(cold.plan) == column_axes(warm.plan) and stored
    assert warm.columns.carried_inputs == cold.columns.carried_inputs


@pytest.mark.parametrize("payload", ["older-layout", "names-a-class"])
def test_an_entry_it_cannot_read_is_a_miss_and_rewritten(payload, monkeypatch):
    art = compile_graph(_decode("llama-gqa", 1.0), PROFILE)
    cold = Emulator(PROFILE).compile(art.mil_text, art.weights)
    store = kernel_store()
    key = art.key(PROFILE)
    if payload == "older-layout":  # format 1's (inputs, outputs, record) under today's number
        data = pickle.dumps((cold.plan.inputs, cold.plan.outputs, []))
    else:
        data = pickle.dumps((np.zeros(3), [], [], None))
    store.path(key).write_bytes(store.header(key, data) + data)
    before = base.compile_count()
    again = Emulator(PROFILE).compile(art.mil_text, art.weights)
    assert base.compile_count() == before + 1  # a miss: compiled cold
    x = _inputs(cold, np.random.default_rng(2))
    assert all(again.plan.run(x)[k].tobytes() == v.tobytes() for k, v in cold.plan.run(x).items())
    rewritten = store.get(key)
    assert rewritten is not None and rewritten != data
    assert structure(warm_compile(art, monkeypatch)) == structure(again)  # and the rewritten entry is a hit
