"""What only a Mac can decide about the real backend (`pytest -m ane`; skipped elsewhere).

Each test settles one fact the backend's rules rest on (docs/ane-backend.md): the
framework deletes the folder on unload, drops its descriptor once the files are written,
keeps compiled programs in aned by hex id, reads NoCopy blobs and reused requests correctly,
survives 115 cold compiles, and the self-test passes in a child process.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from anelm.device import ane
from anelm.device.ane import selftest
from anelm.device.base import compile_count
from anelm.device.ane.objc import ID
from anelm.chip.profile import STRICT

pytestmark = pytest.mark.ane
W = "@model_path/weights/w.bin"


@pytest.fixture
def device(fresh_compile_count):
    ok, reason = ane.available()
    if not ok:
        pytest.skip(f"needs a real Apple Neural Engine (macOS on Apple Silicon): {reason}")
    dev = ane.AneDevice(STRICT.replace(compile_budget=10**6))
    yield dev
    dev.close()


def fresh_program() -> tuple[str, dict, np.ndarray]:
    """y = x * w with a blob w, and a nonce so that aned cannot hold it yet."""
    from anelm.doctor.harness import blob
    from anelm.doctor.milgen import blob_const, const, op, program

    x = (1, 64, 1, 384)
    w = ((np.arange(64) % 7 + 1) / 4).astype(np.float16).reshape(1, 64, 1, 1)
    text = program([("x", "fp16", x)], [const(f"n{secrets.randbelow(2**31)}", "fp16", 0.0),
                                        blob_const("w", "fp16", w.shape, W), op("y", "fp16", x, "mul", x="x", y="w")],
                   ["y"])
    return text, {W: blob(w)[0]}, w


def run(device, model, x: np.ndarray, inp=None, out=None) -> np.ndarray:
    inp, out = inp or device.new_surface(x.nbytes), out or device.new_surface(x.nbytes)
    inp.write(x)
    device.evaluate(model, [inp], [out])
    return out.read(x.nbytes).view(np.float16).reshape(x.shape)


def test_unload_deletes_the_folder_and_a_reload_runs(device):
    text, weights, w = fresh_program()
    m = device.compile(text, weights)
    device.load(m)
    device.unload(m)
    assert not m.folder.exists()  # item 1: the framework's unload removed it
    device.load(m)  # re-created before the load
    x = np.linspace(-2, 2, 64 * 384).astype(np.float16).reshape(1, 64, 1, 384)
    np.testing.assert_allclose(run(device, m, x), x * w, rtol=2e-3)


def test_the_framework_drops_the_descriptor_after_compiling(device):
    text, weights, _ = fresh_program()
    m = device.compile(text, weights)
    assert m.compiled
    rt = ane.ane_framework.framework().rt
    with rt.pool():
        assert not rt.send(m.ptr, "descriptor", ID, [])  # item 2: setDescriptor:nil in saveModelFiles


def test_aned_serves_a_compiled_program_without_a_compile(device):
    text, weights, w = fresh_program()
    first = device.compile(text, weights)
    assert first.compiled and compile_count() == 1
    first.release()
    again = device.compile(text, weights)  # item 7: compiledModelExists says yes
    assert not again.compiled and compile_count() == 1
    device.load(again)
    x = np.ones((1, 64, 1, 384), np.float16)
    np.testing.assert_allclose(run(device, again, x), x * w, rtol=2e-3)


def test_no_copy_blobs_and_a_reused_request_compute_correctly(device):
    text, weights, w = fresh_program()
    m = device.compile(text, weights)
    device.load(m)
    inp, out = device.new_surface(49152), device.new_surface(49152)
    for seed in range(3):  # item 8: one request, new data each time
        x = np.random.default_rng(seed).uniform(-4, 4, (1, 64, 1, 384)).astype(np.float16)
        np.testing.assert_allclose(run(device, m, x, inp, out), x * w, rtol=2e-3)


def test_the_self_test_passes_in_a_child_process():
    ok, reason = ane.available()
    if not ok:
        pytest.skip(reason)
    assert selftest.run_in_child() == (True, "the backend passed its self-test")  # item 4


@pytest.mark.slow
def test_115_cold_compiles_are_all_good():
    from anelm.doctor import BUDGET_PROBE, run_isolated

    if not ane.available()[0]:
        pytest.skip("needs a real Apple Neural Engine")
    res = run_isolated("ane", STRICT, [BUDGET_PROBE], uncapped=True, timeout=600, budget_limit=115)
    assert res.error is None and res.observations[BUDGET_PROBE].outcome == "115"  # item 3
