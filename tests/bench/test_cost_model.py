"""The cost model's arithmetic on programs whose FLOPs and bytes can be counted by hand."""

import numpy as np
import pytest

from anelm.chip.catalog import get_chip
from anelm.chip.cost import KernelCost, eval_time
from anelm.compiler.pipeline import compile_graph
from anelm.ir.builder import GraphBuilder

C, OC, S = 64, 96, 32


def _conv_art():
    b = GraphBuilder("one_conv")
    x = b.input("x", [1, C, 1, S])
    b.output("y", b.conv(x, np.ones((OC, C), np.float32)))
    return compile_graph(b.build())


def _matmul_art(m=16, k=48, n=80):
    b = GraphBuilder("one_matmul")
    x, y = b.input("x", [1, 1, m, k]), b.input("y", [1, 1, k, n])
    b.output("z", b.matmul(x, y))
    return compile_graph(b.build())


def test_conv_flops_and_bytes_equal_the_hand_count():
    k = KernelCost.of(_conv_art())
    assert k.flops == {"conv": 2 * OC * S * C, "matmul": 0, "vector": 0, "int8": 0}
    assert k.weight_bytes == OC * C * 2                      # fp16 weight
    assert k.io_bytes == (C * S + OC * S) * 2                 # packed x and y, fp16
    assert k.ops == (("conv", 2 * OC * S * C, OC * C * 2),)  # a conv holds its weight on chip


def test_matmul_flops_and_operand_bytes():
    k = KernelCost.of(_matmul_art())
    assert k.flops["matmul"] == 2 * 16 * 48 * 80
    assert k.ops == (("matmul", 2 * 16 * 48 * 80, (16 * 48 + 48 * 80) * 2),)
    assert k.weight_bytes == 0 and k.io_bytes == (16 * 48 + 48 * 80 + 16 * 80) * 2


def test_eval_time_is_dispatch_plus_the_larger_of_compute_and_memory():
    chip = get_chip("m4")
    k = KernelCost.of(_conv_art())
    t = eval_time(k, chip)
    assert t.compute_s == pytest.approx(2 * OC * S * C / chip.conv_fp16_flops)
    assert t.memory_s == pytest.approx((OC * C * 2 + (C + OC) * S * 2) / chip.ane_bytes_per_s)
    assert t.total_s == pytest.approx(chip.dispatch_s + max(t.compute_s, t.memory_s))
    assert t.bound == "dispatch"  # a tiny program sits on the dispatch floor


def test_operands_past_the_working_set_run_at_the_slower_rate():
    chip = get_chip("m4")
    small = KernelCost("a", {"matmul": 10**12}, (("matmul", 10**12, 1000),), 0, 0, 0)
    big = KernelCost("b", {"matmul": 10**12}, (("matmul", 10**12, int(chip.working_set_bytes) + 1),), 0, 0, 0)
    ratio = (eval_time(big, chip).compute_s / eval_time(small, chip).compute_s)
    assert ratio == pytest.approx(chip.spill_slowdown)
    assert eval_time(big, chip).spilled_flops == 10**12 and eval_time(small, chip).spilled_flops == 0


def test_device_flops_metric_is_the_annotation_total():
    from anelm.compiler.passes.cost import graph_flops
    from anelm.kernels.training import Dims, build_graph

    m = Dims(64, 128, 4, 2, 16, 32)
    g = build_graph("qkv", m)
    assert KernelCost.of(compile_graph(g)).total_flops == graph_flops(g) == 2 * 32 * 64 * (64 + 2 * 32)


def test_training_kernel_flops_read_from_the_annotation_equal_the_graph_count():
    """The trainer reads device_flops from each compiled kernel's cost annotation: for every
    training kernel it is the count of the graph as built, so the metric is what it was."""
    from anelm.compiler.passes.cost import graph_flops, kernel_flops
    from anelm.kernels.training import KINDS, Dims, build_graph

    m = Dims(64, 128, 4, 2, 16, 32)
    for kind in KINDS:
        assert kernel_flops(compile_graph(build_graph(kind, m))) == graph_flops(build_graph(kind, m)) > 0, kind


def test_vector_work_is_counted_by_class_and_charged_at_its_rate():
    """A softmax over the scores, a sigmoid and a transpose: each lands in its class, and only
    the row-wise and transcendental classes take time (arithmetic and moves ride along)."""
    h, s = 2, 16
    b = GraphBuilder("vec")
    x = b.input("x", [1, h, s, s])
    p = b.softmax(b.add(x, b.scalar(1.0)), axis=-1)
    b.output("y", b.transpose(b.sigmoid(p), [0, 1, 3, 2]))
    k = KernelCost.of(compile_graph(b.build()))
    n = h * s * s
    assert dict(k.vector_elements) == {"elementwise": n, "transcendental": n, "softmax": n, "reduce": 0, "move": n}
    chip = get_chip("m4")
    assert eval_time(k, chip).compute_s == pytest.approx(n / chip.ane_softmax_per_s + n / chip.ane_transcendental_per_s)


def test_maderix_sdpa_forward_counts_its_attention_as_published():
    """sdpaFwd of maderix/ANE's dynamic pipeline (training/training_dynamic/mil_dynamic.h): three
    projections, Q·Kᵀ and P·V, softmax over Hq·S·S scores, outputs concatenated to 2Q + 2KV + D
    channels; a GQA tile adds a concat of K and V."""
    from anelm.bench import maderix

    d, f, hq, hkv, hd, s = 64, 128, 4, 2, 16, 32
    art = compile_graph(maderix.build("sdpaFwd", d, f, hq, hkv, hd, s, 2), maderix.IN_MEMORY)
    k = KernelCost.of(art)
    q, kv = hq * hd, hkv * hd
    assert k.flops["matmul"] == 2 * s * d * (q + 2 * kv) + 2 * 2 * hq * s * s * hd
    assert dict(k.vector_elements)["softmax"] == hq * s * s
    assert tuple(art.signature.outputs[0].shape) == (1, 2 * q + 2 * kv + d, 1, s)
    acts, outs, weights = maderix.io_elements("sdpaFwd", d, f, hq, hkv, hd, s)
    assert (acts, outs, weights) == (d * s, (2 * q + 2 * kv + d) * s, d * (q + 2 * kv))
