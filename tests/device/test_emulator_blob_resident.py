"""A decode conv's fp16-resident weight comes straight from the BLOBFILE (device/emulator_plan,
device/emulator_matvec): planning never decodes it to float32, on a cold compile and on a plan
replayed from the kernel cache.

The oracle for "bit-identical to before" is the route the emulator took before: the blob's fp16
values decoded to float32 (`round_fp16`), then packed back into patterns (`half_bits`) by a
`ResidentWeight` built from that float32 copy. Every one of the 65536 patterns survives that
route unchanged, so the products must agree bit for bit, not within a tolerance.
"""

import numpy as np

from anelm.chip.profile import STRICT
from anelm.compiler.pipeline import compile_graph
from anelm.device.emulator import Emulator
from anelm.device.emulator.matvec import ResidentConv, ResidentWeight, half_bits
from anelm.fp16.grid import round_fp16
from anelm.ir.builder import GraphBuilder
from anelm.runtime.cache import ProgramCache
from anelm.runtime.kernel import Kernel

PROFILE = STRICT.replace(compile_budget=10**9)
WIDTH = STRICT.spatial_multiple_of  # a decode program's width; its token sits in column 0
rng = np.random.default_rng(23)


def test_every_fp16_pattern_survives_the_float32_route_unchanged():
    bits = np.arange(1 << 16, dtype=np.uint16)  # NaN payloads, infinities, -0 and subnormals too
    assert np.array_equal(half_bits(round_fp16(bits.view(np.float16))), bits)


def projection_with_bias(w: np.ndarray, bias: np.ndarray):
    b = GraphBuilder("proj")
    b.output("y", b.linear(b.input("x", [1, w.shape[1], 1, WIDTH]), w, bias))
    return compile_graph(b.build(), PROFILE)


def test_a_planned_decode_conv_holds_the_blob_patterns_and_no_float32_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("ANELM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ANELM_KERNEL_CACHE_MB", raising=False)
    oc, c = 96, 64
    w = round_fp16(rng.standard_normal((oc, c)) * 0.1)
    bias = round_fp16(rng.standard_normal(oc))
    art = projection_with_bias(w, bias)
    blobs = [np.frombuffer(v, np.uint8) for v in art.weights.values()]
    x = np.zeros((1, c, 1, WIDTH), np.float32)
    x[0, :, 0, 0] = round_fp16(rng.standard_normal(c))
    before = ResidentWeight(w.reshape(oc, c, 1, 1)).matvec(x[0, :, 0, 0])  # the float32 route

    for replayed in (False, True):  # a cold compile fills the kernel cache; the second replays it
        with Kernel(art, Emulator(PROFILE), cache=ProgramCache(), float32_outputs=True, read_columns=1) as k:
            plan = k.model.plan
            assert (k.model.func is None) == replayed
            (held,) = [st.fn.weight for st in plan.steps if isinstance(st.fn, ResidentConv)]
            assert held.f32 is None and held.f16.dtype == np.uint16  # before any evaluation
            assert np.array_equal(held.f16, w.astype(np.float16).view(np.uint16))
            assert any(np.shares_memory(held.f16, blob) for blob in blobs)  # the blob's own bytes
            # no const holds the weight's values in float32; the bias, read by an add, is decoded
            assert all(np.size(v) != oc * c for v in plan.consts.values())
            assert any(np.array_equal(np.ravel(v), bias) for v in plan.consts.values()
                       if isinstance(v, np.ndarray) and v.dtype == np.float32)
            assert np.array_equal(held.matvec(x[0, :, 0, 0]), before)
            y = k.run({"x": x})["y"][0, :, 0, 0]
            assert held.f32 is None
            assert np.array_equal(y, round_fp16(round_fp16(before) + bias))  # conv, then add, each rounded
