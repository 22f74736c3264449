"""The published programs as reference configurations, and `anelm bench validate`.

The end-to-end figures were measured on other programs than our presets, so each is predicted
for a configuration that describes the published program (maderix/ANE's training/ and
mechramc/Orion's kernels/training/): its shapes, its batch and accumulation, the CPU work it does,
and what its ms/step counts.
maderix's dynamic pipeline runs its own ten kernels as they are (bench/maderix.py), its first
dynamic version, on which the published breakdown was timed, its nine (bench/maderix_v1.py), its
static pipeline and Orion their six baked ones (bench/maderix_static.py), Orion with the CPU side
its source shows (bench/orion.py); what else differs is listed in `note`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..train.presets import get_preset
from ..chip.catalog import CPU_STREAM_BYTES_PER_ELEMENT, RMSNORM_BYTES_PER_ELEMENT, breakdowns, figures, get_chip, on_runtime
from ..chip.cost import eval_time
from .gen_model import predict_orion_decode
from .programs import conv_chain, matmul, vector_op
from .step_model import StepSpec, predict_step

COMPACT_VOCAB = 9200  # maderix trains on the ids its data uses: 32K/152K -> ~9.2K rows


@dataclass(frozen=True)
class Reference:
    spec: StepSpec
    per_micro_step: bool   # the published ms/step is one micro-step, the update amortized over accum
    note: str
    runtime: str | None = None  # whose eval path dispatches the programs (None: maderix's)


def _stories(ctx: int = 256) -> dict:
    return {**get_preset("stories110m"), "max_position_embeddings": ctx}


def _maderix_qwen3() -> dict:
    """Qwen3-0.6B shapes only: no q/k norm, θ 10000, a Llama layer (maderix/ANE's Qwen3
    configuration in training/training_dynamic/)."""
    c = get_preset("qwen3-0.6b")
    return {**c, "model_type": "llama", "rope_theta": 10000.0, "max_position_embeddings": 256}


_MADERIX = dict(seq_len=256, batch=1, accum=10, qk_norm=False, cpu_rope_forward=False,
                clamp_inputs=False, accumulate_pass=False)
_DYNAMIC = dict(_MADERIX, kernels="maderix")
# the six baked programs (bench/maderix_static.py): forward norms and SwiGLU backward on the
# device, no RoPE; the CPU keeps the classifier, CE, residuals, norm backwards, dW and Adam
_BAKED = dict(kernels="static-reference", pipeline="static", count_recompile=False, rope=False,
              cpu_norm_forward=False, cpu_swiglu_backward=False)
REFERENCES: dict[str, Reference] = {
    "maderix-stories110m-dynamic": Reference(
        StepSpec(_stories(), pipeline="dynamic", classifier_rows=COMPACT_VOCAB, **_DYNAMIC), True,
        "maderix training_dynamic: its 10 kernels per layer as they are (bench/maderix.py), weights in "
        "the inputs, RoPE forward in the kernel, classifier and CE over the ~9.2K ids the data uses, 1x256 tokens, accum 10"),
    "maderix-stories110m-dynamic-v1": Reference(
        StepSpec(_stories(), pipeline="dynamic", classifier_rows=COMPACT_VOCAB, rope=False,
                 **dict(_MADERIX, kernels="maderix-v1")), True,
        "maderix's first dynamic version (bench/maderix_v1.py), the program its step breakdown was "
        "timed on: nine kernels, fp32 surfaces for the weight-bearing ones, every weight copied "
        "into its kernel's input before every evaluation, no RoPE, compact vocabulary, accum 10"),
    "maderix-stories110m-static": Reference(
        StepSpec(_stories(), **_MADERIX, **_BAKED), True,
        "maderix train_large: its six baked programs per layer as they are (bench/maderix_static.py: "
        "RMSNorm, SiLU backward and Wo^T inside, no RoPE), full 32000-row CPU classifier; its ms/step "
        "leaves out the compiles of the exec() restarts"),
    "maderix-qwen3-0.6b-dynamic": Reference(
        StepSpec(_maderix_qwen3(), pipeline="dynamic", classifier_rows=COMPACT_VOCAB, **_DYNAMIC), True,
        "maderix training_dynamic with Qwen3-0.6B shapes: no q/k norm, GQA 16/8, head dim 128, "
        "compact vocabulary, tied embedding"),
    "orion-stories110m": Reference(
        StepSpec(_stories(), seq_len=256, batch=1, accum=4, qk_norm=False, accumulate_pass=False,
                 transposing_io=True, scalar_cross_entropy=True, classifier_dw_on_main=True,
                 zero_and_scale_grads=True, **_BAKED), False,
        "Orion: maderix's six baked programs per layer, fp16 I/O through transposing, clamping "
        "copies from its [S, C] CPU arrays (bench/orion.py), a scalar cross-entropy and the "
        "embedding's dW on the main thread, full-vocab CPU classifier, no RoPE, grad accum 4; "
        "train ms/step (zeroing, micro-steps, 1/accum scaling, Adam) without the weight reload",
        runtime="orion"),
}


def predict_reference(name: str, chip_key: str) -> dict:
    ref = REFERENCES[name]
    out = predict_step(ref.spec, on_runtime(get_chip(chip_key), ref.runtime))
    if ref.per_micro_step:
        a = ref.spec.accum
        out["predicted_step_ms"] /= a
        out["predicted_breakdown"] = {k: v / a for k, v in out["predicted_breakdown"].items()}
    return out


def predict_figure(fig: dict) -> float:
    """The model's value for one published figure, in the figure's unit."""
    p, chip = fig["program"], get_chip(fig["chip"])
    kind = p["type"]
    if kind == "conv_chain":
        return eval_time(conv_chain(p["channels"], p["spatial"], p["depth"], p["dtype"]), chip).total_s * 1e3
    if kind == "int8_speedup":
        args = (p["channels"], p["spatial"], p["depth"])
        return eval_time(conv_chain(*args, "fp16"), chip).total_s / eval_time(conv_chain(*args, "int8"), chip).total_s
    if kind == "matmul":
        return eval_time(matmul(p["n"]), chip).total_s * 1e3
    if kind == "vector_op":
        return eval_time(vector_op(p["op"], p["rows"], p["cols"]), chip).total_s * 1e3
    if kind == "cpu_stream":
        return CPU_STREAM_BYTES_PER_ELEMENT * p["rows"] * p["cols"] / chip.cpu_vector_bytes_per_s * 1e3
    if kind == "cpu_gemm":
        return 2 * p["n"] ** 3 / chip.cpu_sgemm_flops * 1e3
    if kind == "cpu_softmax":
        return p["rows"] * p["cols"] * chip.cpu_exp_s * 1e3
    if kind == "cpu_scalar_ce":
        return p["rows"] * p["cols"] * chip.cpu_scalar_ce_s * 1e3
    if kind == "cpu_rmsnorm":
        return p["norms"] * RMSNORM_BYTES_PER_ELEMENT * p["dim"] * p["tokens"] / chip.cpu_vector_bytes_per_s * 1e3
    if kind == "train":
        return predict_reference(p["reference"], fig["chip"])["predicted_step_ms"]
    if kind == "train_part":  # one published part of a step, in the model's breakdown keys
        return predict_reference(p["reference"], fig["chip"])["predicted_breakdown"][p["part"]]
    if kind == "decode":
        return predict_orion_decode(on_runtime(chip, "orion")) * 1e3
    if kind == "eval_floor":
        return on_runtime(chip, p["runtime"]).dispatch_s * 1e3
    raise ValueError(f"figure {fig['name']!r}: unknown program type {kind!r}")


def _ranks(values: dict[str, float]) -> dict[str, int]:
    order = sorted(values, key=lambda k: -values[k])
    return {k: i + 1 for i, k in enumerate(order)}


def validate() -> dict:
    """Every published figure with the prediction and (predicted − published) / published."""
    rows = []
    for fig in figures():
        pred = predict_figure(fig)
        rows.append({"name": fig["name"], "source": fig["source"], "chip": fig["chip"], "kind": fig["kind"],
                     "unit": fig["unit"], "published": fig["published"], "predicted": pred,
                     "error": (pred - fig["published"]) / fig["published"], "fitted": bool(fig["fitted"]),
                     "note": fig.get("note", "")})
    ranks = []
    for b in breakdowns():
        got = predict_reference(b["reference"], b["chip"])["predicted_breakdown"]
        pub = b["parts"]
        pred = {k: got[k] for k in pub}
        for k in pub:
            rows.append({"name": f"{b['name']}: {k}", "source": b["source"], "chip": b["chip"],
                         "kind": "breakdown", "unit": "ms", "published": pub[k], "predicted": pred[k],
                         "error": (pred[k] - pub[k]) / pub[k], "fitted": False, "note": ""})
        rp, rq = _ranks(pub), _ranks(pred)
        n = len(pub)
        rho = 1 - 6 * sum((rp[k] - rq[k]) ** 2 for k in pub) / (n * (n * n - 1))
        ranks.append({"name": b["name"], "published_order": sorted(pub, key=rp.get),
                      "predicted_order": sorted(pub, key=rq.get), "spearman": rho, "note": b.get("note", "")})
    return {"figures": rows, "breakdown_ranks": ranks}
