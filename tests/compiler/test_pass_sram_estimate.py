"""sram_estimate: weights + largest live activation set; a warning past the measured threshold."""

import warnings

import numpy as np
import pytest

from anelm.compiler.registry import run_pass
from anelm.chip.profile import SRAM_BYTES
from anelm.ir.builder import GraphBuilder


def test_estimate_counts_weights_and_peak_live_activations():
    b = GraphBuilder()
    x = b.input("x", [1, 8, 1, 16])  # 256 B
    h = b.linear(x, np.ones((32, 8)), name="up")  # weight 512 B, result 1024 B
    r = b.relu(h)  # 1024 B; x is dead by now
    b.output("y", b.linear(r, np.ones((8, 32)), name="down"))  # weight 512 B, result 256 B
    g = b.build()
    ops = g.op_list()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not run_pass("sram_estimate", g)
    assert g.op_list() == ops
    s = g.meta["sram"]
    assert s["weights_bytes"] == 1024
    # x + up = 1280 B, then x dies; up + relu = 2048 B is the peak; relu + y = 1280 B
    assert s["activation_bytes"] == 2048
    assert s["estimate_bytes"] == 3072 and s["limit_bytes"] == SRAM_BYTES
    assert "warnings" not in g.meta


def test_large_working_set_warns_and_records():
    b = GraphBuilder("big")
    x = b.input("x", [1, 4096, 1, 64])
    b.output("y", b.linear(x, np.zeros((4096, 4096), np.float16), name="w"))  # 32 MiB of weights
    g = b.build()
    with pytest.warns(UserWarning, match="SRAM working set"):
        run_pass("sram_estimate", g)
    assert g.meta["sram"]["estimate_bytes"] > SRAM_BYTES
    assert f"exceeds the measured {SRAM_BYTES / 1e6:.2f} MB threshold" in g.meta["warnings"][0]


def test_int8_weights_count_once_at_one_byte():
    """A constexpr_affine_dequantize weight is resident as its int8 blob (plus its scales); the
    fp16 tensor it yields is derived when compiled, so the same matrix in int8 counts about half
    its fp16 twin, and not the int8 blob on top of the fp16 size."""
    out_c, in_c = 64, 96
    w = np.random.default_rng(0).integers(-127, 128, (out_c, in_c)).astype(np.int8)
    sizes = {}
    for kind in ("fp16", "int8"):
        b = GraphBuilder(kind)
        x = b.input("x", [1, in_c, 1, 16])
        if kind == "fp16":
            y = b.linear(x, w.astype(np.float16), name="lin")
        else:
            wq = b.constexpr_affine_dequantize(w.reshape(out_c, in_c, 1, 1), np.ones(out_c, np.float16), 0, axis=0)
            y = b.conv(x, wq, name="lin")
        b.output("y", y)
        g = b.build()
        run_pass("sram_estimate", g)
        sizes[kind] = g.meta["sram"]["weights_bytes"]
    assert sizes["fp16"] == 2 * out_c * in_c
    # int8 data, fp16 row scales [out] and an int8 zero point
    assert out_c * in_c <= sizes["int8"] <= out_c * in_c + 2 * out_c + 8
