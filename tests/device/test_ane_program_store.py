"""The program store (anelm/generate/program_store.py) on the real ANE backend, through the fake
framework: a warm runner hands it the very MIL and blob bytes a cold build does, so aned finds
the same hex ids and nothing compiles; the blobs are the runner's own read-only buffers."""

import pytest

import hf_tiny
from ane_fake import Aned, FakeFramework

from anelm.chip.profile import STRICT
from anelm.device.ane import AneDevice
from anelm.generate import program_store
from anelm.generate.pipeline import build_runner
from anelm.models.loading import load_model

NOBUDGET = STRICT.replace(compile_budget=10**9)  # the process-wide count spans every test file


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)


def test_the_ane_backend_gets_the_bytes_a_build_gives(tmp_path):
    hf_tiny.make_hf("llama-rope3", tmp_path / "model", seed=3)
    config, weights, _ = load_model(tmp_path / "model")
    aned = Aned()

    def kernels(process):
        fw = FakeFramework(tmp_path / process, aned)
        runner = build_runner(config, weights, AneDevice(NOBUDGET, framework=fw), max_context=32)
        for i in range(config.num_hidden_layers):
            runner._kernel("prefill", i, 16), runner._kernel("decode", i, 32)
        got = {m["hex"]: (m["mil"], m["blobs"]) for ptr, m in fw.models.items() if ptr != "requests"}
        return got, [c for c in fw.calls if c[0] == "compile"]

    cold, cold_compiles = kernels("p1")
    assert len(cold_compiles) == 2 * config.num_hidden_layers
    assert list(program_store.program_store().root.glob("*.bin"))  # the store was filled
    warm, warm_compiles = kernels("p2")
    assert warm == cold and not warm_compiles
