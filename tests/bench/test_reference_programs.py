"""The reference configurations' structure: the static programs, per-chip CPU constants, runtimes."""

from dataclasses import replace

import pytest

from anelm.bench import maderix_static, orion
from anelm.chip.catalog import Chip, get_chip, on_runtime
from anelm.chip.cost import KernelCost
from anelm.bench.gen_model import predict_orion_decode
from anelm.bench.maderix import IN_MEMORY
from anelm.bench.reference import REFERENCES, predict_reference
from anelm.bench.step_model import IO_BYTES, ZERO_AND_SCALE_BYTES, StepSpec, predict_step
from anelm.errors import UsageError
from anelm.train.presets import count_params
from anelm.compiler.pipeline import compile_graph

D, F, H, S = 64, 128, 4, 32

CPU = ("cpu_sgemm_flops", "cpu_vector_bytes_per_s", "cpu_exp_s")


def _cost(kind):
    art = compile_graph(maderix_static.build(kind, D, F, H, S), IN_MEMORY)
    return KernelCost.of(art), art


def test_static_programs_count_their_convs_and_outputs_as_published():
    """maderix/ANE's static pipeline (training/stories_mil.h): fwdAttn has four D×D convs and six D
    outputs; ffnBwd three D×H convs and runs the SiLU backward (one sigmoid per hidden element) on
    the device."""
    attn, art = _cost("fwdAttn")
    assert attn.flops["conv"] == 4 * 2 * D * D * S
    assert tuple(art.signature.outputs[0].shape) == (1, 6 * D, 1, S)
    bwd, art = _cost("ffnBwd")
    assert bwd.flops["conv"] == 3 * 2 * D * F * S
    assert dict(bwd.vector_elements)["transcendental"] == F * S
    assert tuple(art.signature.outputs[0].shape) == (1, D + 2 * F, 1, S)
    assert maderix_static.io_elements("fwdFFN", D, F, H, S) == (D * S, (2 * D + 3 * F) * S)


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


def test_orion_moves_what_its_step_transposes_and_copies():
    """Orion:kernels/training/stories_train.m, per layer: forward writes x and x2 and reads wo_out
    and w2_out (4 D-channel tensors); backward transposes ten D-channel and three H-channel
    tensors, and copies h1, h3, q, k, v, dx2, probs, dp, q, k, dq, dk, dv surface to surface."""
    assert orion.transposed_elements("forward", D, F, H, S) == 4 * D * S
    assert orion.transposed_elements("backward", D, F, H, S) == (10 * D + 3 * F) * S
    copies = (2 * F + 9 * D + 2 * H * S) * S
    per_element = IO_BYTES + orion.TRANSPOSE_PASS_BYTES
    assert orion.host_io_bytes("forward", D, F, H, S, IO_BYTES) == 4 * D * S * per_element
    assert orion.host_io_bytes("backward", D, F, H, S, IO_BYTES) == (
        (10 * D + 3 * F) * S * per_element + copies * orion.SURFACE_COPY_BYTES)


def _spec(**kw):
    config = {"hidden_size": D, "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": H,
              "num_hidden_layers": 2, "vocab_size": 512, "model_type": "llama", "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "max_position_embeddings": S}
    base = dict(seq_len=S, accum=2, qk_norm=False, accumulate_pass=False, kernels="static-reference",
                pipeline="static", count_recompile=False, rope=False, cpu_norm_forward=False,
                cpu_swiglu_backward=False)
    return StepSpec(config, **{**base, **kw})


def test_each_transposing_copy_costs_its_conversion_and_one_more_pass():
    """k transposed elements cost k conversions plus k fp32 passes; the surface copies add theirs."""
    chip = get_chip("m4-max")
    packed = predict_step(_spec(), chip)["predicted_breakdown"]
    moved = predict_step(_spec(transposing_io=True), chip)["predicted_breakdown"]
    vec, layers, accum = chip.cpu_vector_bytes_per_s, 2, 2
    for side in ("forward", "backward"):
        want = layers * accum * orion.host_io_bytes(side, D, F, H, S, IO_BYTES) / vec * 1e3
        assert moved[f"io_{side}_ms"] == pytest.approx(want)
    assert moved["device_forward_ms"] == pytest.approx(packed["device_forward_ms"])


def test_scalar_cross_entropy_costs_what_maderix_measured_per_logit():
    """110 ms for 32000 x 256 logits as scalar C, 14 ms with vDSP (the maderix README)."""
    m4, mx = get_chip("m4"), get_chip("m4-max")
    assert m4.cpu_scalar_ce_s * 32000 * 256 == pytest.approx(110e-3, rel=1e-4)
    assert mx.cpu_scalar_ce_s == m4.cpu_scalar_ce_s          # the same P-core
    vector = predict_step(_spec(), mx)["predicted_breakdown"]["classifier_ms"]
    scalar = predict_step(_spec(scalar_cross_entropy=True), mx)["predicted_breakdown"]["classifier_ms"]
    logits = 512 * S * 2                                      # vocabulary x positions x micro-steps
    assert scalar - vector == pytest.approx(logits * (mx.cpu_scalar_ce_s - mx.cpu_exp_s) * 1e3)
    with pytest.raises(UsageError, match="scalar cross-entropy"):
        predict_step(_spec(scalar_cross_entropy=True), get_chip("m5"))


def test_orion_runs_the_embedding_dw_on_its_main_thread_and_rescales_gradients():
    chip = get_chip("m4-max")
    queued = predict_step(_spec(), chip)
    main = predict_step(_spec(classifier_dw_on_main=True), chip)
    dw_ms = 2 * 512 * D * S / chip.cpu_sgemm_flops * 1e3 * 2
    assert main["predicted_breakdown"]["classifier_ms"] - queued["predicted_breakdown"]["classifier_ms"] == pytest.approx(dw_ms)
    assert queued["predicted_dw_ms"] - main["predicted_dw_ms"] == pytest.approx(dw_ms)
    zeroed = predict_step(_spec(zero_and_scale_grads=True), chip)["predicted_breakdown"]["optimizer_ms"]
    params = count_params(_spec().config)
    assert zeroed - queued["predicted_breakdown"]["optimizer_ms"] == pytest.approx(
        ZERO_AND_SCALE_BYTES * params / chip.cpu_vector_bytes_per_s * 1e3)


def test_first_dynamic_version_copies_every_weight_into_its_input_before_every_evaluation():
    """training_dynamic/train.m at 60b0512: nine kernels, fp32 surfaces for the weight-bearing
    seven, their weights memcpy'd in at every evaluation; sdpaBwd1/2 on fp16 surfaces."""
    from anelm.bench import maderix_v1
    from anelm.bench.programs import maderix_v1_kernels

    assert len(maderix_v1.KERNELS) == 9
    weights = {k: maderix_v1.host_traffic(k, D, F, H, S).get("weights32", 0) for k in maderix_v1.KERNELS}
    layer_params = 4 * D * D + 3 * D * F
    assert sum(weights[k] for k in maderix_v1.FORWARD) == layer_params
    assert sum(weights[k] for k in maderix_v1.BACKWARD) == layer_params
    assert weights["sdpaBwd1"] == weights["sdpaBwd2"] == 0
    art = compile_graph(maderix_v1.build("sdpaFwd", D, F, H, S), IN_MEMORY)
    assert art.signature.inputs[0].dtype == "fp32" and tuple(art.signature.inputs[0].shape) == (1, D, 1, S + 4 * D)
    assert tuple(art.signature.outputs[0].shape) == (1, 6 * D, 1, S)
    cost = KernelCost.of(art)
    assert cost.flops["matmul"] >= 4 * 2 * D * D * S                 # q, k, v and Wo in one program
    dims = REFERENCES["maderix-stories110m-dynamic-v1"].spec.dims
    staged = sum(k.weight_elements for k in maderix_v1_kernels(dims))
    assert staged == 0                                               # nothing restaged after the update


def test_weights_copied_every_evaluation_cost_the_io_their_bytes_say():
    """8 bytes (fp32 read and write) per weight and evaluation at the chip's memory rate: making
    the memory twice as fast halves exactly the weights' share of the I/O parts."""
    chip = get_chip("m4")
    spec = REFERENCES["maderix-stories110m-dynamic-v1"].spec
    slow = predict_step(spec, chip)["predicted_breakdown"]
    fast_chip = replace(chip, values={**chip.values, "cpu_dram_bytes_per_s": 2 * chip.cpu_dram_bytes_per_s})
    fast = predict_step(spec, fast_chip)["predicted_breakdown"]
    m, layers, accum = spec.dims, spec.config["num_hidden_layers"], spec.accum
    weights_ms = layers * accum * (4 * m.d * m.d + 3 * m.d * m.f) * 8 / chip.cpu_dram_bytes_per_s * 1e3
    for side in ("forward", "backward"):
        assert slow[f"io_{side}_ms"] - fast[f"io_{side}_ms"] == pytest.approx(weights_ms / 2)


@pytest.mark.parametrize("preset", ["stories110m", "qwen3-0.6b"])
def test_anelm_micro_step_is_under_four_fifths_of_maderixs_on_the_m4(preset):
    """`anelm bench train` in maderix's setting (seq 256, batch 1, 10 micro-steps an update),
    `--head-on` at its default: anelm's pipeline as the trainer runs it on the ANE (its classifier
    on the GPU, the SwiGLU backward and RoPE in the kernels, the clamps in the fp16 conversion)
    against maderix's dynamic pipeline, both priced by the same cost model (anelm's AdamW and
    restaging split over the M4's four performance cores, maderix's on its main thread)."""
    from anelm.bench.commands import train

    out, _, _ = train("m4", preset, "dynamic", measure=False, repeat=1, batch_size=1, grad_accum=10)
    assert out["head_on"] == "gpu"
    assert out["predicted_micro_step_ms"] <= 0.8 * out["maderix_micro_step_ms"], out


def test_a_pass_split_over_the_cores_runs_at_their_rate_until_the_memory_is_the_limit():
    """AdamW and the restaging of anelm's trainer run on a pool of workers (train/optim.py,
    DynamicBank.set_weights); the references' on one thread. Split n ways, a pass runs at n cores'
    rate, capped by the published memory bandwidth: on the M4 4 x 36 GB/s > 120, so 120."""
    from anelm.bench.step_model import ADAMW_BYTES, pass_bytes_per_s
    from anelm.runtime.threads import MAX_PASS_WORKERS

    m4 = get_chip("m4")
    assert m4.cpu_performance_cores == 4
    assert pass_bytes_per_s(m4, False) == m4.cpu_vector_bytes_per_s
    assert pass_bytes_per_s(m4, True) == m4.cpu_dram_bytes_per_s == 120e9
    slow_memory = replace(m4, values={**m4.values, "cpu_dram_bytes_per_s": 1e15})
    assert pass_bytes_per_s(slow_memory, True) == 4 * m4.cpu_vector_bytes_per_s  # the cores' limit
    many = replace(slow_memory, values={**slow_memory.values, "cpu_performance_cores": 64})
    assert pass_bytes_per_s(many, True) == MAX_PASS_WORKERS * m4.cpu_vector_bytes_per_s  # the pool's
    unpublished = replace(slow_memory, values={k: v for k, v in m4.values.items() if k != "cpu_performance_cores"})
    assert pass_bytes_per_s(unpublished, True) == m4.cpu_vector_bytes_per_s  # one core where not published
    # the optimizer's part of a step is its bytes at that rate; the references keep one thread
    serial = predict_step(_spec(), m4)["predicted_breakdown"]["optimizer_ms"]
    split = predict_step(_spec(parallel_update=True), m4)["predicted_breakdown"]["optimizer_ms"]
    params = count_params(_spec().config)
    assert serial == pytest.approx(ADAMW_BYTES * params / m4.cpu_vector_bytes_per_s * 1e3)
    assert split == pytest.approx(ADAMW_BYTES * params / 120e9 * 1e3)
    assert all(not r.spec.parallel_update for r in REFERENCES.values())


def test_probabilities_left_on_the_device_cross_no_surface():
    """anelm's step in maderix's setting: with the carried probabilities on the device
    (`resident_fits`), each I/O part is smaller by exactly their conversions, read after sdpa_fwd
    and written before sdpa_bwd, every layer and micro-step; past the budget they cross again."""
    from anelm.bench.step_model import anelm_spec
    from anelm.train.presets import get_preset

    cfg, chip = get_preset("stories110m"), get_chip("m4")
    spec = anelm_spec(cfg, 256, 1, 10, "dynamic", "cpu")
    assert spec.carry_probs and spec.resident_probs
    kept = predict_step(spec, chip)["predicted_breakdown"]
    host = predict_step(replace(spec, resident_probs=False), chip)["predicted_breakdown"]
    m = spec.dims
    probs_ms = cfg["num_hidden_layers"] * 10 * m.hq * m.s * m.s * IO_BYTES / chip.cpu_vector_bytes_per_s * 1e3
    for side in ("forward", "backward"):
        assert host[f"io_{side}_ms"] - kept[f"io_{side}_ms"] == pytest.approx(probs_ms)
    # two slots of 12 layers' 12 x 256 x 256 fp16 probabilities a sequence: 8 fit 512 MB, 16 do not
    assert anelm_spec(cfg, 256, 8, 10, "dynamic", "cpu").resident_probs
    assert not anelm_spec(cfg, 256, 16, 10, "dynamic", "cpu").resident_probs
