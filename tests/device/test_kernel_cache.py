"""The emulator's on-disk kernel cache (device/emulator/cache.py, device/disk_cache.py).

A hit must give the very program a cold compile gives (outputs compared bit for bit, on a
decoder layer and on both int8 forms, whose plans are rewritten at build time), without
parsing or planning and without charging the 115-compile budget. The store is
checked for its bound, its least-recently-used order, damaged entries, and two processes
filling it at once.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anelm.chip.profile import STRICT
from anelm.compiler.artifact import content_key
from anelm.compiler.pipeline import compile_graph
from anelm.device import base
from anelm.device.emulator import builder as emulator_builder
from anelm.device.disk_cache import HEADER, DiskCache
from anelm.device.emulator import Emulator
from anelm.device.emulator.cache import FORMAT, kernel_store
from anelm.errors import AnelmError, CompileBudgetExceeded
from anelm.ir.builder import GraphBuilder
from anelm.mil import parser as mil_parser
from anelm.kernels.qlinear import QLinear
from anelm.kernels.qlinear import quant_linear
from anelm.runtime.cache import ProgramCache
from anelm.runtime.kernel import Kernel

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Each test starts with an empty cache folder of its own."""
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)


def layer_artifact(seed=0):
    from anelm.kernels.blocks import decoder_layer
    from anelm.models.config import LlamaConfig
    from anelm.models.names import random_layer

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      rms_norm_eps=1e-5, max_position_embeddings=32)
    return compile_graph(decoder_layer(cfg, random_layer(cfg, seed=seed), 32, index=0))


def int8_artifact(act_scale):
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, size=(40, 96)).astype(np.int8)
    ql = QLinear(q, rng.uniform(0.5, 2.0, 40).astype(np.float32) * 2.0 ** -9, act_scale=act_scale)
    b = GraphBuilder("int8")
    x = b.input("x", [1, 96, 1, 16])
    b.output("y", quant_linear(b, x, ql, None, "lin"))
    return compile_graph(b.build())


def inputs_for(art, seed=1):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in art.signature.inputs}


def run(art, arrays):
    """Outputs of one fresh device (its own in-process cache: every call reaches the device)."""
    return Kernel(art, Emulator(STRICT), cache=ProgramCache())(**arrays)


def forbid_parse_and_plan(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a cache hit parsed or planned")
    monkeypatch.setattr(mil_parser, "parse", refuse)
    monkeypatch.setattr(emulator_builder._Builder, "build", refuse)


@pytest.mark.parametrize("make", [layer_artifact, lambda: int8_artifact(None), lambda: int8_artifact(0.05)],
                         ids=["decoder-layer", "int8-w8", "int8-w8a8"])
def test_a_hit_skips_parse_and_plan_and_gives_the_cold_results_bit_for_bit(make, monkeypatch):
    art = make()
    x = inputs_for(art)
    before = base.compile_count()
    cold = run(art, x)
    assert base.compile_count() == before + 1
    assert kernel_store().get(art.key(STRICT)) is not None  # the cold compile filled the entry
    forbid_parse_and_plan(monkeypatch)
    warm = run(art, x)
    assert base.compile_count() == before + 1  # loaded, not compiled: the budget is not charged
    assert sorted(warm) == sorted(cold)
    for k in cold:
        assert warm[k].dtype == cold[k].dtype and warm[k].tobytes() == cold[k].tobytes(), k


def test_an_entry_holds_no_weights():
    art = layer_artifact()
    run(art, inputs_for(art))
    entry = kernel_store().path(art.key(STRICT)).read_bytes()
    blob = max(art.weights.values(), key=len)
    assert len(entry) < sum(map(len, art.weights.values())) / 4  # a fraction of the weights' size
    assert blob[128:128 + 256] not in entry  # and no run of its payload is inside


def test_hits_never_reach_the_compile_budget(monkeypatch):
    art = int8_artifact(None)
    x = inputs_for(art)
    run(art, x)
    for _ in range(STRICT.compile_budget + 5):  # more loads than the budget has compiles
        Emulator(STRICT).compile(art.mil_text, art.weights)
    assert base.compile_count() == 1
    base.reset_compile_count()
    monkeypatch.setenv("ANELM_KERNEL_CACHE_MB", "0")  # the cache off: every compile is cold again
    dev = Emulator(STRICT)
    for _ in range(STRICT.compile_budget):
        dev.compile(art.mil_text, art.weights)
    with pytest.raises(CompileBudgetExceeded):
        dev.compile(art.mil_text, art.weights)


def test_the_key_covers_text_blobs_and_profile():
    art = layer_artifact()
    other = STRICT.replace(name="other", accumulator_limit=None)
    assert art.key(STRICT) == content_key(art.mil_text, art.weights, STRICT)
    assert art.key(other) != art.key(STRICT)
    assert art.key(STRICT.replace(name="renamed")) == art.key(STRICT)  # a name changes no program
    path = next(iter(art.weights))
    changed = dict(art.weights, **{path: art.weights[path][:-1] + b"\x01"})
    assert content_key(art.mil_text, changed, STRICT) != art.key(STRICT)
    art.weights[path] = changed[path]  # a new blob object: the memo must not answer for it
    assert art.key(STRICT) == content_key(art.mil_text, changed, STRICT)


@pytest.mark.parametrize("damage", ["truncate", "flip-payload-byte", "older-format", "garbage"])
def test_a_damaged_entry_is_ignored_and_rewritten(damage):
    art = layer_artifact()
    x = inputs_for(art)
    cold = run(art, x)
    store = kernel_store()
    path = store.path(art.key(STRICT))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip-payload-byte":
        data[-10] ^= 0xFF
    elif damage == "older-format":
        payload = bytes(data[HEADER.size:])
        data = DiskCache(store.root, FORMAT - 1).header(art.key(STRICT), payload) + payload
    else:
        data = b"\x00" * 40
    path.write_bytes(bytes(data))
    before = base.compile_count()
    again = run(art, x)
    assert base.compile_count() == before + 1  # ignored: a cold compile
    assert all(again[k].tobytes() == cold[k].tobytes() for k in cold)
    assert store.get(art.key(STRICT)) is not None  # and rewritten whole


def test_least_recently_used_entries_go_first_within_the_bound(tmp_path):
    store = DiskCache(tmp_path / "store", version=1, limit=3 * (1000 + HEADER.size))
    keys = [f"{i:064x}" for i in range(4)]
    for i, k in enumerate(keys[:3]):
        store.put(k, bytes([i]) * 1000)
        os.utime(store.path(k), ns=(10**9 * (i + 1), 10**9 * (i + 1)))  # a, b, c in that order
    assert store.get(keys[0]) == b"\x00" * 1000  # a is used again: now the most recent
    store.put(keys[3], b"\x03" * 1000)  # over the bound by one entry
    present = [store.get(k) is not None for k in keys]
    assert present == [True, False, True, True]  # b, the least recently used, went
    total = sum(p.stat().st_size for p in store.root.glob("*.bin"))
    assert total <= store.limit


def test_an_entry_larger_than_the_bound_is_not_kept(tmp_path):
    store = DiskCache(tmp_path / "store", version=1, limit=500)
    store.put("a" * 64, b"x" * 1000)
    assert store.get("a" * 64) is None and not list(store.root.glob("*.bin"))


def test_the_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ANELM_KERNEL_CACHE_MB", "3")
    assert kernel_store().limit == 3 << 20
    monkeypatch.setenv("ANELM_KERNEL_CACHE_MB", "two")
    with pytest.raises(AnelmError, match="ANELM_KERNEL_CACHE_MB='two': expected a whole number"):
        kernel_store()


FILL = """
import sys
from anelm.compiler.pipeline import compile_graph
from anelm.device import base
from anelm.device.emulator import Emulator
from anelm.ir.builder import GraphBuilder
import numpy as np
for i in range(int(sys.argv[1])):
    b = GraphBuilder("p%d" % i)
    x = b.input("x", [1, 64, 1, 16])
    w = np.random.default_rng(i).standard_normal((64, 64)).astype(np.float32)
    b.output("y", b.relu(b.linear(x, w, name="lin")))
    art = compile_graph(b.build())
    Emulator().compile(art.mil_text, art.weights)
print(base.compile_count())
"""


def test_two_processes_filling_the_cache_at_once_leave_whole_entries(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    n = 12
    procs = [subprocess.Popen([sys.executable, "-c", FILL, str(n)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    store = kernel_store()
    files = sorted(store.root.iterdir())
    assert len(files) == n and all(f.suffix == ".bin" for f in files)  # no temp files left behind
    assert all(store.get(f.name.split(".")[0]) is not None for f in files)  # every entry checks out
    third = subprocess.run([sys.executable, "-c", FILL, str(n)], env=env, capture_output=True, text=True,
                           timeout=600)
    assert third.returncode == 0 and third.stdout.strip() == "0"  # all loaded, none compiled


def test_puts_within_the_bound_list_the_folder_once_and_one_past_it_trims(tmp_path, monkeypatch):
    import anelm.device.disk_cache as dc

    listed = []
    real = os.scandir
    monkeypatch.setattr(dc.os, "scandir", lambda p: listed.append(p) or real(p))
    store = DiskCache(tmp_path / "store", version=1, limit=5 * (1000 + HEADER.size))
    keys = [f"{i:064x}" for i in range(7)]
    for i, k in enumerate(keys[:5]):
        store.put(k, bytes([i]) * 1000)
        os.utime(store.path(k), ns=(10**9 * (i + 1), 10**9 * (i + 1)))
    assert len(listed) == 1  # the first put learns the folder's total; four more fit the bound
    other = DiskCache(tmp_path / "store", version=1, limit=store.limit)  # another handle, same folder
    other.put(keys[5], b"\x05" * 1000)  # past the bound: listed again, the oldest entry goes
    assert len(listed) == 2 and store.get(keys[0]) is None
    assert [store.get(k) is not None for k in keys[1:6]] == [True] * 5
    assert sum(p.stat().st_size for p in store.root.glob("*.bin")) <= store.limit


def test_two_formats_in_one_folder_keep_their_own_entries(tmp_path):
    old, new = (DiskCache(tmp_path / "store", version=v) for v in (1, 2))
    key = "c" * 64
    old.put(key, b"format one")
    assert new.get(key) is None  # another format's entry is not this one's...
    new.put(key, b"format two")
    assert old.get(key) == b"format one" and new.get(key) == b"format two"  # ...and is not deleted as damaged
