"""A kernel-cache hit (device/emulator/cache.py) replays the very plan a cold compile builds.

Oracle: the plan of the cold compile, in the same process. The warm compile is made in a fresh
device with parsing and building forbidden, so only the stored entry and the caller's blobs can
give its plan. Both plans are run on the same inputs, whole (`Plan.run`) and, for decode's
column-separable kernels, column by column (`ColumnPlan.run`), with and without the overflow
watch: every output must be the same bytes and the first overflowing op the same (the
overflow warning of docs/chip-profiles.md; weights scaled up so that some op overflows, and
plain ones where none does). The replayed plan's structure
(steps, frees, consts, column axes) is compared too, as the entry now keeps what the build
derived instead of deriving it again. An entry of an older layout under the current format
number, or one that names a class, is a miss, compiled cold and rewritten.
"""

import gc
import io
import pickle
import weakref

import numpy as np
import pytest

from anelm.compiler.pipeline import compile_graph
from anelm.device import base
from anelm.device.emulator import builder as emulator_builder
from anelm.device.emulator import cache as emulator_cache
from anelm.device.emulator import Emulator
from anelm.device.emulator.cache import _Unpickler, kernel_store
from anelm.device.emulator.columns import column_axes
from anelm.kernels.decode import decode_layer
from anelm.kernels.qlinear import qlinear
from anelm.kernels.layers import layer_params, layer_shape
from anelm.kernels.prefill import prefill_layer
from anelm.mil import parser as mil_parser
from anelm.models.names import random_layer
from anelm.models.formats.quantized import InputQuant
from test_emulator_columns import CONFIGS, PROFILE, W, _inputs

WEIGHT_SCALES = {"plain": 1.0, "overflowing": 16.0}  # x16 weights: attention scores or an MLP product pass 65504


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Each test starts with an empty kernel cache of its own."""
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)


def _layer(kind: str, factor: float, int8: bool = False, seed: int = 5):
    s = layer_shape(CONFIGS[kind], 0)
    p = layer_params(s, {k: v * factor for k, v in random_layer(CONFIGS[kind], seed=seed).items()})
    if int8:  # the int8 linears of a quantized folder, biases kept in fp16
        p = {n: (qlinear(w, InputQuant()), b) if w.ndim == 2 else (w, b) for n, (w, b) in p.items()}
    return s, p


def _prefill(kind: str, factor: float, seed: int = 5):
    return prefill_layer(*_layer(kind, factor, seed=seed), 2 * W)


def _decode(kind: str, factor: float, int8: bool = False, seed: int = 5):
    s, p = _layer(kind, factor, int8, seed)
    return decode_layer(s, p, 64, rope=s.family.rotary, name=f"decode_{kind}", columns=W)


PROGRAMS = {f"prefill-{k}": (lambda f, seed=5, k=k: _prefill(k, f, seed)) for k in CONFIGS}
PROGRAMS.update({f"decode-{k}": (lambda f, seed=5, k=k: _decode(k, f, seed=seed)) for k in CONFIGS})
PROGRAMS["decode-llama-int8"] = lambda f, seed=5: _decode("llama-gqa", f, int8=True, seed=seed)


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


def same_runs(got, want, overflowing: bool | None = None) -> None:
    """Two `runs` alike: every output the same bytes, the same first overflow; with
    `overflowing`, the watch found something exactly when the weights are heavy."""
    assert sorted(got) == sorted(want)
    for way, (ref, ref_found) in want.items():
        res, found = got[way]
        assert sorted(res) == sorted(ref)
        for k in ref:
            assert res[k].dtype == ref[k].dtype and res[k].tobytes() == ref[k].tobytes(), (way, k)
        assert found == ref_found, way
        if overflowing is not None and found is not None:
            assert bool(found) == overflowing, (way, found)


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
    for watch in (False, True):  # the watch has something to find exactly when the weights are heavy
        same_runs(runs(warm, x, watch), runs(cold, x, watch), weights == "overflowing")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("weights", sorted(WEIGHT_SCALES))
def test_layers_of_one_text_loaded_one_after_another_run_as_built(name, weights, monkeypatch):
    """A model's layers: one program text, other weights, so entries alike but for the key. The
    first load decodes the entry and replays it in full; the next ones reuse what it made that no
    weight changes (emulator.builder.Shared) and must still run each with its own weights, as
    each layer's cold compile does, and unlike the other layers."""
    arts = [compile_graph(PROGRAMS[name](WEIGHT_SCALES[weights], seed), PROFILE) for seed in (5, 6, 7)]
    assert len({a.mil_text for a in arts}) == 1 and len({a.key(PROFILE) for a in arts}) == 3
    colds = [Emulator(PROFILE).compile(a.mil_text, a.weights) for a in arts]
    payloads = [kernel_store().get(a.key(PROFILE)) for a in arts]
    assert payloads[0] == payloads[1] == payloads[2]
    emulator_cache._MET.clear()  # as in a new process
    shared = []
    real = emulator_builder._Builder._replay_shared
    monkeypatch.setattr(emulator_builder._Builder, "_replay_shared", lambda b, *a: shared.append(1) or real(b, *a))
    warms = [warm_compile(a, monkeypatch) for a in arts]
    assert len(shared) == 2  # the second and third layers
    if warms[0].columns is not None:  # and their one-column plans bind the steps they share once
        assert any(a is b for a, b in zip(warms[0].columns.bound.steps, warms[2].columns.bound.steps))
    x = _inputs(colds[0], np.random.default_rng(3))
    outputs = []
    for cold, warm in zip(colds, warms):
        assert structure(warm) == structure(cold)
        for watch in (False, True):
            want = runs(cold, x, watch)
            same_runs(runs(warm, x, watch), want, weights == "overflowing" if watch else None)
        outputs.append(b"".join(a.tobytes() for a in want["whole"][0].values()))
    assert len(set(outputs)) == 3  # each layer's weights show in its outputs


@pytest.mark.parametrize("name", ["decode-llama-gqa", "prefill-llama-gqa"])
def test_what_a_process_keeps_of_its_loads_holds_no_layers_weights(name, monkeypatch):
    """The decoded entries and what their loads share stay for the process; the weights they
    were loaded with go with the models (here: arrays the blobs are read-only views of)."""
    arts = [compile_graph(PROGRAMS[name](1.0, seed), PROFILE) for seed in (5, 6)]
    for a in arts:
        Emulator(PROFILE).compile(a.mil_text, a.weights)
    emulator_cache._MET.clear()
    owners = [{k: np.frombuffer(bytes(v), np.uint8) for k, v in a.weights.items()} for a in arts]
    for arrays in owners:
        for v in arrays.values():
            v.flags.writeable = False
    gone = [weakref.ref(v) for arrays in owners for v in arrays.values()]
    models = [Emulator(PROFILE).compile(a.mil_text, {k: memoryview(v) for k, v in arrays.items()})
              for a, arrays in zip(arts, owners)]
    assert all(m.func is None for m in models)  # both loaded from the kernel cache, the second shared
    del models, owners, arrays, v
    gc.collect()
    assert all(r() is None for r in gone)


def test_an_entry_met_before_that_does_not_fit_the_weights_is_a_miss(monkeypatch):
    """An entry decoded earlier in the process, planted under another program's key, whose
    blobs it does not fit: a miss, compiled cold and rewritten, as it would be if never met."""
    llama, gpt2 = (compile_graph(_decode(k, 1.0), PROFILE) for k in ("llama-gqa", "gpt2"))
    Emulator(PROFILE).compile(llama.mil_text, llama.weights)
    warm_compile(llama, monkeypatch)  # decoded and kept in this process
    store, key = kernel_store(), gpt2.key(PROFILE)
    planted = store.get(llama.key(PROFILE))
    store.path(key).write_bytes(store.header(key, planted) + planted)
    before = base.compile_count()
    again = Emulator(PROFILE).compile(gpt2.mil_text, gpt2.weights)
    assert base.compile_count() == before + 1 and store.get(key) != planted
    cold = Emulator(PROFILE).compile(gpt2.mil_text, gpt2.weights)
    x = _inputs(cold, np.random.default_rng(4))
    same_runs(runs(again, x, True), runs(cold, x, True))


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
