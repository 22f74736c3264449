"""The program store (anelm/generate/program_store.py): a warm runner finds its programs before
building them.

Oracle: the cold build of the same runner. A hit must give the very programs it would have
built (MIL text, every blob's bytes, the content key, signature and meta) and generation bit
for bit the same logits, while building nothing (`compile_graph` is made to fail) and charging
no compile to the 115-compile budget. A key must miss when one weight element changes or when the
source fingerprint changes; a damaged entry is a miss, rebuilt and rewritten; an entry holds
no copy of the weights. (The real ANE backend: tests/device/test_ane_program_store.py.)
"""

import numpy as np
import pytest

import hf_tiny

from anelm import caches
from anelm.chip.profile import STRICT
from anelm.device import base
from anelm.device.disk_cache import HEADER
from anelm.device.emulator import Emulator
from anelm.generate import pipeline, program_store
from anelm.generate.pipeline import build_runner
from anelm.models.loading import load_model

NOBUDGET = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test file
PROMPT, TOKENS = [1, 5, 9, 22, 7], [3, 40, 11]  # prefill bucket 16, then three decode steps


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Each test starts with empty stores of its own (kernels and programs)."""
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (config, float32 weights) of a tiny HF model."""
    root = tmp_path_factory.mktemp("store")
    out = {}
    for i, kind in enumerate(["llama-rope3", "gpt2", "qwen3-tied"]):
        hf_tiny.make_hf(kind, root / kind, seed=30 + i)
        config, weights, _ = load_model(root / kind)
        out[kind] = (config, weights)
    return out


class Builds:
    """Counts `compile_graph` calls by program name; `forbid()` makes the next one fail."""

    def __init__(self, monkeypatch):
        self.names, self.allowed = [], True
        real = pipeline.compile_graph

        def counted(graph, profile):
            assert self.allowed, f"{graph.name} was built on a warm run"
            self.names.append(graph.name)
            return real(graph, profile)
        monkeypatch.setattr(pipeline, "compile_graph", counted)

    def forbid(self):
        self.allowed = False


def generate(config, weights, device, **kw):
    """(runner, logits of a prefill and three decode steps [4, V]) on `device`."""
    runner = build_runner(config, weights, device, max_context=32, **kw)
    cache = runner.new_cache()
    rows = [runner.prefill(PROMPT, cache, last_only=True)]
    rows += [runner.decode(t, cache)[None] for t in TOKENS]
    return runner, np.concatenate(rows)


def programs(runner) -> dict:
    """Every compiled program of a runner: text, blob bytes, content key, signature, meta."""
    p = runner.dev.profile
    return {k: (kern.artifact.mil_text, {path: bytes(b) for path, b in kern.artifact.weights.items()},
                kern.artifact.key(p), kern.artifact.signature, kern.artifact.meta)
            for k, kern in runner.kernels.items()}


@pytest.mark.parametrize("kind,lora", [("llama-rope3", False), ("gpt2", False), ("qwen3-tied", False),
                                       ("llama-rope3", True)], ids=["llama", "gpt2", "qwen3", "llama-lora"])
def test_a_warm_runner_builds_nothing_and_gives_the_cold_programs_and_logits(tiny, kind, lora, monkeypatch):
    config, weights = tiny[kind]
    kw = {"lora_rank": 4, "lora_targets": ("q_proj", "down_proj")} if lora else {}
    builds = Builds(monkeypatch)
    cold_dev = Emulator(NOBUDGET)
    cold, cold_logits = generate(config, weights, cold_dev, **kw)
    assert len(builds.names) == len(cold.kernels) == 2 * config.num_hidden_layers
    builds.forbid()
    before = base.compile_count()
    warm, warm_logits = generate(config, weights, Emulator(NOBUDGET), **kw)  # another device: no in-process hit
    assert base.compile_count() == before  # the plans come from the kernel store: loaded, not compiled
    assert warm_logits.tobytes() == cold_logits.tobytes()
    assert programs(warm) == programs(cold)
    # the weights' blobs are the runner's own blob-backed arrays, not copies
    w = next(a for a, _ in warm.layers[0].values())
    blobs = [b for kern in warm.kernels.values() for b in kern.artifact.weights.values()]
    assert any(isinstance(b, memoryview) and np.shares_memory(np.frombuffer(b, np.uint8), w) for b in blobs)


@pytest.mark.parametrize("name,at", [("model.layers.1.mlp.down_proj.weight", (3, 5)),
                                     ("model.layers.1.self_attn.o_proj.bias", (7,))], ids=["matrix", "bias"])
def test_one_changed_weight_element_misses_that_layer_only(tiny, name, at, monkeypatch):
    """A matrix's blob is served from the runner's own array, a bias's from the entry's bytes:
    either way the layer's digest in the key must make the changed layer a miss."""
    config, weights = tiny["llama-rope3"]
    generate(config, weights, Emulator(NOBUDGET))
    changed = dict(weights)
    changed[name] = weights[name].copy()
    changed[name][at] = 2.0 * changed[name][at] + 0.5  # one element, well beyond an fp16 step
    builds = Builds(monkeypatch)
    warm, logits = generate(config, changed, Emulator(NOBUDGET))
    assert sorted(builds.names) == ["decode_l1_t32", "prefill_l1_s16"]
    base.reset_compile_count()
    monkeypatch.setenv("ANELM_KERNEL_CACHE_MB", "0")  # both stores off: the cold build of the changed model
    cold, cold_logits = generate(config, changed, Emulator(NOBUDGET))
    assert logits.tobytes() == cold_logits.tobytes() and programs(warm) == programs(cold)


def test_a_changed_source_fingerprint_misses_everything(tiny, monkeypatch):
    config, weights = tiny["gpt2"]
    generate(config, weights, Emulator(NOBUDGET))
    monkeypatch.setattr(program_store, "source_fingerprint", lambda: "an edited package")
    builds = Builds(monkeypatch)
    generate(config, weights, Emulator(NOBUDGET))
    assert len(builds.names) == 2 * config.num_hidden_layers


@pytest.mark.parametrize("damage", ["flip-byte", "truncate", "bad-payload", "unknown-weight"])
def test_a_damaged_entry_is_ignored_and_rewritten(tiny, damage, monkeypatch):
    config, weights = tiny["qwen3-tied"]
    _, cold_logits = generate(config, weights, Emulator(NOBUDGET))
    store = program_store.program_store()
    files = sorted(store.root.glob("*.bin"))
    assert len(files) == 2 * config.num_hidden_layers
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "flip-byte":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncate":
            data = data[: len(data) // 3]
        key = f.name.split(".")[0]
        if damage == "bad-payload":  # a whole, checksummed entry whose content does not read
            store.put(key, b"\x07" * 64)
        elif damage == "unknown-weight":  # an entry naming a weight the layer does not have
            payload = bytes(data[HEADER.size:]).replace(b'"weight": "', b'"weight": "0', 1)
            store.put(key, payload)
        else:
            f.write_bytes(bytes(data))
    builds = Builds(monkeypatch)
    _, logits = generate(config, weights, Emulator(NOBUDGET))
    assert len(builds.names) == 2 * config.num_hidden_layers  # every entry ignored: built again
    assert logits.tobytes() == cold_logits.tobytes()
    builds.forbid()
    generate(config, weights, Emulator(NOBUDGET))  # and rewritten whole: the next run builds nothing


def test_an_entry_holds_no_copy_of_the_weights(tiny):
    config, weights = tiny["llama-rope3"]
    runner, _ = generate(config, weights, Emulator(NOBUDGET))
    store = program_store.program_store()
    for f in store.root.glob("*.bin"):
        entry = f.read_bytes()
        for w, _ in runner.layers[0].values():
            assert w.tobytes()[:256] not in entry
    largest = max(f.stat().st_size for f in store.root.glob("*.bin"))
    assert largest < sum(w.nbytes for w, _ in runner.layers[0].values()) / 2


def test_a_large_unmatched_blob_writes_no_entry(tiny, monkeypatch):
    config, weights = tiny["gpt2"]
    monkeypatch.setattr(program_store, "SMALL_BLOB", 64)  # every bias and norm vector is now "large"
    generate(config, weights, Emulator(NOBUDGET))
    assert not list(program_store.program_store().root.glob("*.bin"))


def test_a_warm_hit_gives_the_notice_its_compile_gave(tiny, monkeypatch):
    """A program past the SRAM threshold says so whether it was compiled or found in the store:
    the same program runs either way (here every tiny program passes a 1-byte threshold)."""
    from anelm.compiler.passes import validate

    monkeypatch.setattr(validate, "SRAM_BYTES", 1)
    config, weights = tiny["gpt2"]
    with pytest.warns(UserWarning, match="SRAM working set exceeds"):
        generate(config, weights, Emulator(NOBUDGET))
    Builds(monkeypatch).forbid()
    with pytest.warns(UserWarning, match="SRAM working set exceeds"):
        generate(config, weights, Emulator(NOBUDGET))


def _tree(root, files, age_s=10.0):
    """Source files under root, their modification times `age_s` in the past."""
    import os
    import time

    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        t = time.time() - age_s
        os.utime(path, (t, t))
    return str(root)


def _read_fingerprint(root):
    """The fingerprint from the files' bytes alone: what the memo must agree with."""
    import os
    import struct

    import xxhash

    h = xxhash.xxh3_128()
    for folder, subs, files in os.walk(root):
        subs[:] = sorted(d for d in subs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith((".py", ".lark", ".json"))):
            path = os.path.join(folder, name)
            data = open(path, "rb").read()
            h.update(os.path.relpath(path, root).encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


def test_the_remembered_source_fingerprint_is_the_files_and_follows_an_edit(tmp_path, monkeypatch):
    root = _tree(tmp_path / "pkg", {"a.py": "x = 1\n", "sub/b.py": "y = 2\n", "g.lark": "start: x\n",
                                    "notes.txt": "not a source"})
    first = caches.tree_fingerprint(root)
    assert first == _read_fingerprint(root)
    memos = list((tmp_path / "cache" / "programs" / "sources").iterdir())
    assert len(memos) == 1 and memos[0].read_text() == first
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k))
    assert caches.tree_fingerprint(root) == first and not [p for p in reads if str(p).endswith(".py")]
    monkeypatch.undo()
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    _tree(tmp_path / "pkg", {"sub/b.py": "y = 3\n"})  # same size, new bytes and time
    assert caches.tree_fingerprint(root) == _read_fingerprint(root) != first
    _tree(tmp_path / "pkg", {"c.py": ""})  # a new file
    assert caches.tree_fingerprint(root) == _read_fingerprint(root)


def test_a_damaged_memo_is_not_trusted_and_a_fresh_tree_is_not_remembered(tmp_path):
    root = _tree(tmp_path / "pkg", {"a.py": "x = 1\n"})
    want = caches.tree_fingerprint(root)
    (memo,) = (tmp_path / "cache" / "programs" / "sources").iterdir()
    memo.write_text("not a digest")
    assert caches.tree_fingerprint(root) == want and memo.read_text() == want  # rewritten
    fresh = _tree(tmp_path / "new", {"a.py": "x = 2\n"}, age_s=0)  # edited within the clock's resolution
    memo.unlink()
    assert caches.tree_fingerprint(fresh) == _read_fingerprint(fresh)
    assert not list((tmp_path / "cache" / "programs" / "sources").iterdir())


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """scheme -> (config, weights) of the tiny word model quantized by `anelm quantize`."""
    from anelm.cli.main import main  # noqa: PLC0415

    root = tmp_path_factory.mktemp("q8")
    hf_tiny.make_word_model(root / "llama")
    text = root / "text.txt"
    ids = np.random.default_rng(3).integers(3, 96, 200).tolist()
    text.write_text(" ".join(hf_tiny.WORDS[i] for i in ids) + "\n", encoding="utf-8")
    out = {}
    for scheme in ("w8", "w8a8", "w4", "lut4"):
        assert main(["quantize", "--model", str(root / "llama"), "--out", str(root / scheme), "--scheme", scheme,
                     "--data", str(text), "--calib-tokens", "64", "--eval-tokens", "64", "--device", "emulator"]) == 0
        config, weights, _ = load_model(root / scheme)
        out[scheme] = (config, weights)
    return out


@pytest.mark.parametrize("scheme", ["w8", "w8a8", "w4", "lut4"])
def test_quantized_layers_are_stored_and_served_warm(quantized, scheme, monkeypatch):
    """A quantized folder's runner finds its programs warm too: the cold programs and logits,
    nothing built. Int8 linears (docs/quantization.md) are served from their int8 weights (the blobs are the
    runner's own q arrays); W4 and LUT layers' digests cover their blocks, tables and indices."""
    config, weights = quantized[scheme]
    assert getattr(weights, "quant", None) is not None
    builds = Builds(monkeypatch)
    cold, cold_logits = generate(config, weights, Emulator(NOBUDGET))
    assert len(builds.names) == 2 * config.num_hidden_layers
    builds.forbid()
    warm, warm_logits = generate(config, weights, Emulator(NOBUDGET))
    assert warm_logits.tobytes() == cold_logits.tobytes()
    assert programs(warm) == programs(cold)
    if scheme in ("w8", "w8a8"):
        q = next(w.q for w, _ in warm.layers[0].values() if hasattr(w, "q"))
        blobs = [b for kern in warm.kernels.values() for b in kern.artifact.weights.values()]
        assert any(isinstance(b, memoryview) and np.shares_memory(np.frombuffer(b, np.uint8), q) for b in blobs)
