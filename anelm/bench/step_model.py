"""The predicted training step: the device kernels, the CPU side, and how they overlap.

A step is `accum` micro-steps of `batch` sequences of S tokens, then one optimizer update.
Per micro-step, as the trainer (anelm/train/steps/llama.py) and maderix's dynamic pipeline run it:

    forward    per layer: device qkv, sdpa_fwd, wo, ffn_up, ffn_down; CPU norms, RoPE, residuals
    head       CPU final norm, classifier logits and dy (sgemm), softmax cross-entropy; or in
               vocabulary tiles on the ANE, or on the GPU (train/steps/placement.py)
    backward   per layer: device dx kernels; CPU SwiGLU backward, norm backward, inverse RoPE
    dW         CPU sgemm on a worker queue, overlapping the backward (anelm: and the next micro-
               step's forward, but for the last); only what outlasts them shows
    update     AdamW over every parameter (dynamic: the new weights restaged into the inputs;
               static: every weighted kernel recompiled), once per step

maderix's static pipeline and Orion (`kernels="static-reference"`) run their six baked programs
instead, with the forward norms and the SwiGLU backward inside them and no RoPE anywhere; their
CPU keeps the residuals, the classifier, the norm backwards, dW and the optimizer. Orion's CPU
does that its own way (bench/orion.py): transposing copies to and from its `[S, C]` arrays, a
scalar cross-entropy, the embedding's dW on the main thread, gradients zeroed and rescaled.

Device time comes from the compiled kernels (cost.py). CPU time comes from the chip's published
CPU figures: sgemm FLOPs at `cpu_sgemm_flops`, elementwise passes as fp32 bytes at
`cpu_vector_bytes_per_s` (M4: a vDSP RMSNorm timing; other chips: a CPU streaming pass), host I/O as bytes converted
between the fp32 arrays and the fp16 surfaces at the same rate. Never the host's speed.
A pass the program splits into chunks over worker threads (anelm's AdamW and restaging) runs at
that rate per performance core, until the memory's published bandwidth is the limit
(`pass_bytes_per_s`); the references' run on one thread (maderix/ANE's `adam_update` and its
staging are plain loops on the main thread), at one core's rate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UsageError
from ..models.names import has_head_norms
from ..runtime.threads import pass_workers
from ..train.steps.cpu_ops import matmul_flops
from ..train.steps.placement import fastest_head, head_seconds
from . import orion
from ..chip.catalog import RMSNORM_BYTES_PER_ELEMENT, Chip
from ..chip.cost import IO_BYTES, eval_time
from .programs import maderix_kernels, maderix_v1_kernels, static_reference_kernels, train_kernels

F32 = 4                       # fp32 bytes
RMS_FWD = 12                  # of RMSNORM_BYTES_PER_ELEMENT: the forward's share (read 2, write 1)
ADAMW_BYTES = 28              # per parameter: read p, g, m, v; write p, m, v (fp32)
ACCUMULATE_BYTES = 12         # per parameter and extra micro-step: read acc, g; write acc
ZERO_AND_SCALE_BYTES = 12     # per parameter and step: memset g (4), g *= 1/accum (read 4, write 4)
# host traffic by how it moves (StepKernel.host_traffic): (bytes per element, rate constant).
# Weights copied into an input at every evaluation stream from DRAM (tens of MB a layer, past the
# caches), as the decode model's CPU classifier reads its table (gen_model.py)
HOST_BYTES = {"convert": (IO_BYTES, "cpu_vector_bytes_per_s"), "copy32": (8, "cpu_vector_bytes_per_s"),
              "copy16": (4, "cpu_vector_bytes_per_s"), "weights32": (8, "cpu_dram_bytes_per_s")}


@dataclass(frozen=True)
class StepSpec:
    """What a training step runs: a model config (HF dict) and the run's shape."""

    config: dict
    seq_len: int
    batch: int = 1
    accum: int = 1
    pipeline: str = "dynamic"
    classifier_rows: int | None = None   # a compacted vocabulary (maderix): rows the CPU uses
    qk_norm: bool | None = None          # None: from the config (Qwen3 has q/k norms)
    count_recompile: bool = True         # static: charge the per-update recompiles to the step
    # CPU work that differs between programs (maderix: RoPE forward in the kernel, no clamps; its
    # static pipeline and Orion: no RoPE at all, the forward norms and the SwiGLU backward inside
    # the programs; anelm: its clamps saturate inside the fp16 conversion, no pass of their own)
    kernels: str = "anelm"               # "maderix": its ten dynamic programs (bench/maderix.py);
                                         # "static-reference": the six baked ones (maderix_static.py)
    cpu_rope_forward: bool = True
    clamp_inputs: bool = True
    # a separate pass adding each micro-batch's gradients to the accumulator; anelm's trainer,
    # like maderix's, accumulates inside the dW sgemm (β = 1, train/steps/gemm.py) and has none
    accumulate_pass: bool = False
    rope: bool = True                    # False: the program has no rotary embedding anywhere
    cpu_norm_forward: bool = True
    cpu_swiglu_backward: bool = True
    # Orion (bench/orion.py): [S, C] CPU arrays, so each tensor crossing a surface is transposed;
    # a scalar cross-entropy; the classifier's dW on the main thread; the gradients zeroed and
    # scaled by 1/accum every step
    transposing_io: bool = False
    scalar_cross_entropy: bool = False
    classifier_dw_on_main: bool = False
    zero_and_scale_grads: bool = False
    # where the classifier and its loss run (train/steps/placement.py: "cpu", "ane" in vocabulary
    # tiles, or "auto", the one predicted faster on the chip); the references' run on the CPU
    head_on: str = "cpu"
    # where the embedding's gather and scatter run: "cpu", or "gpu" (rows and their gradient
    # copied across, the table restaged per update)
    embed_on: str = "cpu"
    # a GPU head runs beside the next micro-step's forward, but for the last (anelm's trainer:
    # DeviceTrainStep.loss_and_grads(ahead=)); else in the step's path
    head_ahead: bool = False
    # anelm's ffn_down_dx with the SwiGLU backward inside (kernels.training Dims.swiglu_dx), as
    # the trainer runs Llama-family layers on the ANE (`anelm_spec`)
    swiglu_on_device: bool = False
    # a micro-step's dW left running beside the next micro-step's forward (anelm's Llama family:
    # DeviceTrainStep.loss_and_grads(defer=)); else the backward alone hides it
    dw_overlaps_forward: bool = False
    # RoPE and its inverse inside anelm's attention kernels (kernels.training_attn, `Dims.rope`),
    # as the trainer runs rotary families on the ANE; their tables cross as one more input
    rope_on_device: bool = False
    # sdpa_bwd takes the forward's probabilities rather than recomputing them (`Dims.carry_probs`),
    # as the trainer does where the host can keep them (`kernels.training.carry_fits`)
    carry_probs: bool = False
    # with the SwiGLU backward on the device, ffn_down_dx and ffn_up_dx as one kernel
    # (`Dims.ffn_dx`), as the trainer runs them but for LoRA
    ffn_dx: bool = False
    # the carried probabilities left on the device between sdpa_fwd and sdpa_bwd, as the trainer
    # does where they fit (`kernels.training.resident_fits`)
    resident_probs: bool = False
    # AdamW and the dynamic pipeline's restaging split into chunks across the CPU's cores, as
    # anelm's trainer runs them (train/optim.py's workers, `DynamicBank.set_weights`' pool)
    parallel_update: bool = False

    @property
    def dims(self):
        from ..kernels.training import Dims

        c = self.config
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return Dims(c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                    c.get("num_key_value_heads") or c["num_attention_heads"], hd, self.seq_len,
                    swiglu_dx=self.swiglu_on_device, rope=self.rope_on_device, carry_probs=self.carry_probs,
                    ffn_dx=self.ffn_dx and self.swiglu_on_device)


def anelm_spec(config: dict, seq_len: int, batch: int, accum: int, pipeline: str, head_on: str,
               embed_on: str = "cpu") -> StepSpec:
    """anelm's own step as the trainer runs it on the ANE: the classifier at `head_on`, and the
    SwiGLU backward on the device for the Llama family (in one kernel with ffn_up_dx), RoPE inside the attention kernels for
    rotary families (train/steps/llama.py), the attention probabilities carried from the forward
    to the backward where the host can keep them (on the device where they fit), AdamW and the
    restaging over the CPU's cores, and the activations' clamp to fp16's range
    inside their conversion (`KernelBank.run`), so no clamping pass."""
    from ..kernels.families import family_for
    from ..kernels.training import carry_fits, resident_fits

    family = family_for(config.get("model_type", "llama"))
    swiglu = family.gated and family.activation == "silu"  # as train/steps/llama.py decides it
    spec = StepSpec(config, seq_len, batch, accum, pipeline, head_on=head_on, swiglu_on_device=swiglu,
                    dw_overlaps_forward=swiglu, embed_on=embed_on, head_ahead=True, rope_on_device=family.rotary,
                    clamp_inputs=False, ffn_dx=swiglu, parallel_update=True)
    spec = replace(spec, carry_probs=carry_fits(spec.dims, config["num_hidden_layers"]))
    return replace(spec, resident_probs=resident_fits(spec.dims, config["num_hidden_layers"], batch))


def _params(c: dict) -> int:
    from ..train.presets import count_params

    return count_params(c)


def pass_bytes_per_s(chip: Chip, parallel: bool) -> float:
    """The rate of an elementwise pass: one core's, or split over the chip's performance cores
    (as many as the trainer's pools take: `runtime.threads.pass_workers`), each at one core's
    rate, until the memory's bandwidth is the limit (M4: 4 × 36 GB/s, capped at 120)."""
    if not parallel:
        return chip.cpu_vector_bytes_per_s
    cores = pass_workers(int(chip.values.get("cpu_performance_cores", 1)))
    return min(cores * chip.cpu_vector_bytes_per_s, chip.cpu_dram_bytes_per_s)


def host_io_s(k, chip: Chip) -> float:
    """Seconds the CPU spends moving one evaluation's inputs and results."""
    if not k.host_traffic:
        return (k.act_in_elements + k.out_elements) * IO_BYTES / chip.cpu_vector_bytes_per_s
    return sum(n * HOST_BYTES[how][0] / chip.values[HOST_BYTES[how][1]] for how, n in k.host_traffic)


def _cross_entropy_s(spec: StepSpec, chip: Chip) -> float:
    """Seconds per logit of the cross-entropy pass (softmax, loss, gradient)."""
    if not spec.scalar_cross_entropy:
        return chip.cpu_exp_s
    if "cpu_scalar_ce_s" not in chip.values:
        raise UsageError(f"chip {chip.key} has no published scalar cross-entropy cost (cpu_scalar_ce_s); "
                         "expected a chip whose data-file entry names one")
    return chip.values["cpu_scalar_ce_s"]


def predict_step(spec: StepSpec, chip: Chip) -> dict:
    """Predicted time of one optimizer step, its additive breakdown and the per-kernel table."""
    m, c = spec.dims, spec.config
    layers, n = c["num_hidden_layers"], spec.batch * spec.seq_len
    vocab = spec.classifier_rows or c["vocab_size"]
    qk = has_head_norms(c.get("model_type")) if spec.qk_norm is None else spec.qk_norm
    evals = layers * spec.batch
    vec = chip.cpu_vector_bytes_per_s
    kernels, dev = [], {"forward": 0.0, "backward": 0.0}
    io = {"forward": 0.0, "backward": 0.0}
    ks = {"maderix": lambda: maderix_kernels(m, layers), "maderix-v1": lambda: maderix_v1_kernels(m),
          "static-reference": lambda: static_reference_kernels(m)}.get(
        spec.kernels, lambda: train_kernels(m, spec.pipeline, spec.resident_probs))()
    for k in ks:
        t = eval_time(k.cost, chip)
        side = "forward" if k.forward else "backward"
        dev[side] += t.total_s * evals
        io[side] += host_io_s(k, chip) * evals
        kernels.append({"kernel": k.kind, "side": side, "evaluations": evals, "eval_ms": t.total_s * 1e3,
                        "bound": t.bound, "flops": k.cost.total_flops, "bytes": k.cost.bytes_moved,
                        "working_set_bytes": k.cost.working_set_bytes, "spilled_flops": t.spilled_flops,
                        "_weights": k.weight_elements})
    if spec.transposing_io:
        io = {side: layers * spec.batch * orion.host_io_bytes(side, m.d, m.f, m.hq, m.s, IO_BYTES) / vec
              for side in io}
    qkv = m.q + m.kv
    rms_fwd = layers * 2 * RMS_FWD * m.d * n / vec if spec.cpu_norm_forward else 0.0
    rms_bwd = layers * 2 * (RMSNORM_BYTES_PER_ELEMENT - RMS_FWD) * m.d * n / vec
    # SwiGLU backward: one loop over H·N reading dgate, h1, h3 and writing dh1, dh3, with one
    # exp per element (σ(h1)); the exp pass costs what the chip's CPU softmax costs per element
    cpu_swiglu = spec.cpu_swiglu_backward and not spec.swiglu_on_device
    swiglu = layers * max(20 * m.f * n / vec, m.f * n * chip.cpu_exp_s) if cpu_swiglu else 0.0
    # residual adds, RoPE (reads cos/sin), fp16 clamps of what enters a surface, q/k norms
    cpu_rope = spec.rope and not spec.rope_on_device
    other_fwd = layers * n * (2 * 12 * m.d + (16 * qkv if spec.cpu_rope_forward and cpu_rope else 0)
                              + (8 * (2 * m.d + qkv) if spec.clamp_inputs else 0) + (12 * qkv if qk else 0)) / vec
    other_bwd = layers * n * (2 * 12 * m.d + (16 * qkv if cpu_rope else 0) + (20 * qkv if qk else 0)) / vec
    # final norm and embedding gather as bytes; the classifier where it runs (train/steps/placement.py:
    # on the CPU its cross-entropy is the chip's CPU softmax per logit, or a scalar one's cost)
    ce = _cross_entropy_s(spec, chip)
    place = spec.head_on if spec.head_on != "auto" else fastest_head(vocab, m.d, m.s, spec.batch, spec.accum, chip, ce)
    head = head_seconds(place, vocab, m.d, m.s, spec.batch, chip, ce)
    classifier_dw = head["dw"]
    # the embedding: gather and scatter-add (16 bytes an element) on the CPU; on the GPU its rows
    # and their gradient cross (8) and the gradient's rows are added to the CPU's buffer (12)
    embed = (20 if spec.embed_on == "gpu" else 16) * m.d  # bytes per position
    classifier = head["main"] + (RMSNORM_BYTES_PER_ELEMENT * m.d + embed) * n / vec
    dw = layers * (matmul_flops(m.d, n, 2 * m.q + 2 * m.kv) + matmul_flops(m.d, n, 3 * m.f)) / chip.cpu_sgemm_flops
    if spec.classifier_dw_on_main:
        classifier += classifier_dw
    else:
        dw += classifier_dw
    bwd_main = dev["backward"] + io["backward"] + swiglu + rms_bwd + other_bwd
    dw_exposed = max(0.0, dw - bwd_main)
    gpu = head["gpu"]
    if spec.head_ahead:  # beside the next micro-step's forward: only what outlasts it shows
        fwd_main = dev["forward"] + io["forward"] + rms_fwd + other_fwd
        gpu = ((spec.accum - 1) * max(0.0, gpu - fwd_main) + gpu) / spec.accum
    gpu += max(0.0, head["gpu_beside"] - bwd_main)  # dW's GEMM beside the backward
    if spec.dw_overlaps_forward:  # all but the last micro-step's dW run on into the next forward
        fwd_main = dev["forward"] + io["forward"] + rms_fwd + other_fwd + classifier
        dw_exposed = ((spec.accum - 1) * max(0.0, dw - bwd_main - fwd_main) + dw_exposed) / spec.accum
    p = _params(c)
    accumulate = ACCUMULATE_BYTES * p * (spec.accum - 1) if spec.accumulate_pass else 0
    grad_passes = ZERO_AND_SCALE_BYTES * p if spec.zero_and_scale_grads else 0
    update = pass_bytes_per_s(chip, spec.parallel_update)
    optimizer = (ADAMW_BYTES * p + accumulate + grad_passes) / update
    restage, recompile = head["restage"], 0.0  # the head's tiles are data in either pipeline
    if spec.embed_on == "gpu":
        restage += F32 * c["vocab_size"] * m.d / vec
    if spec.pipeline == "dynamic":
        restage += layers * sum(k.pop("_weights") for k in kernels) * IO_BYTES / update
    else:
        weighted = sum(1 for k in kernels if k.pop("_weights"))
        recompile = weighted * layers * chip.compile_s if spec.count_recompile else 0.0
    a = spec.accum
    parts = {"device_forward_ms": dev["forward"] * a, "device_backward_ms": dev["backward"] * a,
             "io_forward_ms": io["forward"] * a, "io_backward_ms": io["backward"] * a,
             "restage_ms": restage, "classifier_ms": classifier * a, "swiglu_backward_ms": swiglu * a,
             "rmsnorm_ms": (rms_fwd + rms_bwd) * a, "other_cpu_ms": (other_fwd + other_bwd) * a,
             "dw_exposed_ms": dw_exposed * a, "optimizer_ms": optimizer, "recompile_ms": recompile,
             "gpu_ms": gpu * a}
    parts = {k: v * 1e3 for k, v in parts.items()}
    step_ms = sum(parts.values())
    for k in kernels:
        k["share"] = k["eval_ms"] * k["evaluations"] * a / step_ms
    return {"chip": chip.key, "head_on": place, "predicted_step_ms": step_ms, "predicted_breakdown": parts,
            "predicted_dispatch_ms": chip.dispatch_s * 1e3 * len(kernels) * evals * a,
            "predicted_dw_ms": dw * 1e3 * a, "predicted_device_flops": sum(
                k["flops"] for k in kernels) * evals * a, "kernels": kernels}
