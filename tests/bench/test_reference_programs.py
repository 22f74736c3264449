"""The reference configurations' structure: the static programs, per-chip CPU constants, runtimes."""

from dataclasses import replace

import pytest

from anelm.bench import maderix_static
from anelm.bench.chips import Chip, get_chip, on_runtime
from anelm.bench.cost import KernelCost
from anelm.bench.gen_model import predict_orion_decode
from anelm.bench.maderix import IN_MEMORY
from anelm.bench.reference import REFERENCES, predict_reference
from anelm.bench.step_model import predict_step
from anelm.compiler.pipeline import compile_graph

D, F, H, S = 64, 128, 4, 32

CPU = ("cpu_sgemm_flops", "cpu_vector_bytes_per_s", "cpu_exp_s")


def _cost(kind):
    art = compile_graph(maderix_static.build(kind, D, F, H, S), IN_MEMORY)
    return KernelCost.of(art), art


def test_static_programs_count_their_convs_and_outputs_as_published():
    """maderix-ane-facts §5.5: fwdAttn has four D×D convs and six D outputs; ffnBwd three D×H
    convs and runs the SiLU backward (one sigmoid per hidden element) on the device."""
    attn, art = _cost("fwdAttn")
    assert attn.flops["conv"] == 4 * 2 * D * D * S
    assert tuple(art.signature.outputs[0].shape) == (1, 6 * D, 1, S)
    bwd, art = _cost("ffnBwd")
    assert bwd.flops["conv"] == 3 * 2 * D * F * S
    assert dict(bwd.vector_elements)["transcendental"] == F * S
    assert tuple(art.signature.outputs[0].shape) == (1, D + 2 * F, 1, S)
    assert maderix_static.io_elements("fwdFFN", D, F, H, S) == (D * S, (2 * D + 3 * F) * S)
    assert maderix_static.io_elements("fwdFFN", D, F, H, S, uniform_outputs=True) == (D * S, 5 * F * S)


def test_baked_programs_leave_the_swiglu_backward_and_forward_norms_off_the_cpu():
    dynamic = predict_reference("maderix-stories110m-dynamic", "m4")["predicted_breakdown"]
    static = predict_reference("maderix-stories110m-static", "m4")["predicted_breakdown"]
    assert dynamic["swiglu_backward_ms"] > 0 and static["swiglu_backward_ms"] == 0
    assert 0 < static["rmsnorm_ms"] < dynamic["rmsnorm_ms"]          # the backward stays on the CPU
    kinds = {k["kernel"] for k in predict_reference("maderix-stories110m-static", "m4")["kernels"]}
    assert kinds == set(maderix_static.KERNELS)


def _with_cpu_of(chip: Chip, donor: Chip) -> Chip:
    return replace(chip, values={**chip.values, **{c: donor.values[c] for c in CPU}})


def test_chips_with_two_p_clusters_run_the_cpu_side_faster_as_their_sources_say():
    """ANEForge's runs: M4 Pro/Max GEMM at ~2x M4 (two P-clusters, one matrix unit each) and
    stream ~3.5x; with M4's CPU figures the M4 Max's static step would be far slower."""
    m4, pro, mx = get_chip("m4"), get_chip("m4-pro"), get_chip("m4-max")
    for c in (pro, mx):
        assert c.cpu_sgemm_flops > 1.7 * m4.cpu_sgemm_flops
        assert c.cpu_vector_bytes_per_s > 3 * m4.cpu_vector_bytes_per_s
    spec = REFERENCES["maderix-stories110m-static"].spec
    fast = predict_step(spec, mx)
    slow = predict_step(spec, _with_cpu_of(mx, m4))
    assert fast["predicted_step_ms"] < 0.8 * slow["predicted_step_ms"]
    assert fast["predicted_breakdown"]["classifier_ms"] < slow["predicted_breakdown"]["classifier_ms"]
    assert fast["predicted_breakdown"]["device_forward_ms"] == pytest.approx(
        slow["predicted_breakdown"]["device_forward_ms"])  # the device side is untouched


def test_orion_programs_dispatch_at_its_runtimes_measured_floor():
    mx = get_chip("m4-max")
    orion = on_runtime(mx, "orion")
    assert orion.dispatch_s == pytest.approx(0.15e-3) and on_runtime(mx, None) is mx
    m4 = get_chip("m4")
    assert on_runtime(m4, "orion").dispatch_s == m4.dispatch_s  # no Orion figure: the chip's own floor
    evals = 24  # two programs per GPT-2 layer
    assert predict_orion_decode(orion) - predict_orion_decode(mx) == pytest.approx(
        evals * (orion.dispatch_s - mx.dispatch_s), rel=1e-6)
