"""The benchmarks of `anelm bench`: each returns (the JSON object, lines for a human, PNG maker).

On a machine without the ANE every benchmark predicts the chip and measures the emulator beside
it (`emulator_*` keys); `measured_*` keys are the ANE's own figures and stay null elsewhere.
"""

from __future__ import annotations

from ..errors import UsageError
from . import programs
from ..chip.catalog import chip_names, get_chip
from ..chip.cost import eval_time
from .gen_model import predict_generate
from .reference import validate
from .step_model import StepSpec, anelm_spec, predict_step

PEAK_CONFIGS = (("fp16", 512, 4096, 128), ("int8", 512, 4096, 128))
EMULATED_DEPTH = 4  # the emulator runs a 4-deep chain of the same width (the 128-deep one takes minutes)
SRAM_SIZES = (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
EMULATED_MAX_N = 1024


def _device(measure: bool):
    if not measure:
        return None
    from ..device.select import get_device

    return get_device("auto")


def _measured_key(device) -> str:
    return "measured" if device is not None and device.name == "ane" else "emulator"


def _cpu_figures(device, **figures: float) -> dict:
    """The emulator's figures by its CPU time, as `emulator_cpu_<name>`: what `--baseline` judges
    the emulator on, since other processes stretch its wall-clock figures (measure.Timing). None
    on the ANE, whose work is not this process's CPU time."""
    return {f"emulator_cpu_{k}": v for k, v in figures.items()} if _measured_key(device) == "emulator" else {}


def peak(chip: str, measure: bool, repeat: int, **_) -> tuple[dict, list[str], object]:
    c, dev, rows, lines = get_chip(chip), _device(measure), [], []
    for dtype, ch, sp, depth in PEAK_CONFIGS:
        k = programs.conv_chain(ch, sp, depth, dtype)
        t = eval_time(k, c).total_s
        row = {"dtype": dtype, "channels": ch, "spatial": sp, "depth": depth,
               "predicted_ms": t * 1e3, "predicted_tflops": k.total_flops / t / 1e12}
        if dev is not None:
            from .measure import time_program

            _, art = programs.compiled(("conv_chain", ch, sp, EMULATED_DEPTH, dtype),
                                       lambda: programs.conv_chain_graph(ch, sp, EMULATED_DEPTH, dtype))
            t = time_program(art, dev, repeat)
            row[f"{_measured_key(dev)}_depth{EMULATED_DEPTH}_ms"] = t.wall * 1e3
            row[f"{_measured_key(dev)}_tflops"] = 2 * ch * ch * sp * EMULATED_DEPTH / t.wall / 1e12
            row.update(_cpu_figures(dev, **{f"depth{EMULATED_DEPTH}_ms": t.cpu * 1e3}))
        rows.append(row)
        lines.append(f"{dtype:5s} {depth}x conv {ch}ch sp{sp}: predicted {row['predicted_ms']:.2f} ms "
                     f"({row['predicted_tflops']:.1f} TFLOP/s) on {c.name}")
    return {"chip": chip, "peak": rows}, lines, None


def sram(chip: str, chips: list[str], measure: bool, repeat: int, **_):
    dev, rows, lines = _device(measure), [], []
    for n in SRAM_SIZES:
        k = programs.matmul(n)
        row = {"n": n, "working_set_bytes": k.working_set_bytes,
               "predicted_ms": {key: eval_time(k, get_chip(key)).total_s * 1e3 for key in chips}}
        if dev is not None and n <= EMULATED_MAX_N:
            from .measure import time_program

            row["measured_ms"] = time_program(programs.compiled(("matmul", n), lambda: None)[1], dev, repeat).wall * 1e3
            row["measured_on"] = dev.name
        rows.append(row)
        pred = ", ".join(f"{key} {v:.3f}" for key, v in row["predicted_ms"].items())
        lines.append(f"matmul {n}^3, working set {k.working_set_bytes / 2**20:.2f} MiB: predicted ms {pred}"
                     + (f"; {dev.name} {row['measured_ms']:.1f} ms" if "measured_ms" in row else ""))
    thresholds = {key: get_chip(key).working_set_bytes for key in chips}

    def png(path):
        from .plots import sram_png

        sram_png(path, rows, chips)
    return {"chip": chip, "working_set_threshold_bytes": thresholds, "sweep": rows}, lines, png


# the reference configuration of maderix's own run of a preset's model (bench/reference.py)
MADERIX = {"stories110m": "maderix-stories110m-dynamic", "qwen3-0.6b": "maderix-qwen3-0.6b-dynamic"}


def _spec(preset: str, seq_len, batch, accum, pipeline, head_on: str = "auto", embed_on: str = "cpu") -> StepSpec:
    from ..train.presets import TRAIN_DEFAULTS, get_preset

    cfg, d = get_preset(preset), TRAIN_DEFAULTS.get(preset, {})
    seq = seq_len or d.get("seq_len", 256)
    if seq > cfg["max_position_embeddings"]:
        raise UsageError(f"--seq-len {seq}: expected at most the preset's context {cfg['max_position_embeddings']}")
    return anelm_spec(cfg, seq, batch or d.get("batch_size", 8), accum or 1, pipeline, head_on, embed_on)


def train(chip: str, preset: str | None, pipeline: str, measure: bool, repeat: int,
          seq_len=None, batch_size=None, grad_accum=None, head_on="auto", embed_on="cpu", **_):
    preset = preset or "tiny"
    spec = _spec(preset, seq_len, batch_size, grad_accum, pipeline, head_on, embed_on)
    r = predict_step(spec, get_chip(chip))
    out = {"chip": chip, "preset": preset, "pipeline": pipeline, "head_on": r["head_on"], "embed_on": embed_on,
           "seq_len": spec.seq_len,
           "batch_size": spec.batch, "grad_accum": spec.accum, "predicted_step_ms": r["predicted_step_ms"],
           "predicted_breakdown": r["predicted_breakdown"], "predicted_dispatch_ms": r["predicted_dispatch_ms"],
           "predicted_dw_ms": r["predicted_dw_ms"], "emulator_step_ms": None, "measured_step_ms": None}
    ref = MADERIX.get(preset)
    if ref is not None:  # the reference the issue measures against, in its setting (per micro-step)
        from .reference import predict_reference

        out["predicted_micro_step_ms"] = r["predicted_step_ms"] / spec.accum
        out["maderix_micro_step_ms"] = predict_reference(ref, chip)["predicted_step_ms"]
    dev = _device(measure)
    if dev is not None:
        from .measure import time_train_step

        t = time_train_step(spec.config, dev, spec.seq_len, spec.batch, pipeline, repeat).scaled(spec.accum * 1e3)
        out[f"{_measured_key(dev)}_step_ms"] = t.wall  # forward + backward; the update is not timed
        out.update(_cpu_figures(dev, step_ms=t.cpu))
    lines = [f"{preset} ({pipeline}, head on {r['head_on']}, {spec.batch}x{spec.seq_len} tokens, accum {spec.accum}) on "
             f"{get_chip(chip).name}: predicted {r['predicted_step_ms']:.1f} ms/step"]
    lines += [f"  {k:<20s} {v:9.2f} ms" for k, v in r["predicted_breakdown"].items()]
    if ref is not None:
        lines.append(f"per micro-step {out['predicted_micro_step_ms']:.1f} ms; maderix's dynamic pipeline "
                     f"({ref}, seq 256, batch 1, its compact vocabulary): {out['maderix_micro_step_ms']:.1f} ms")
    for key in ("emulator_step_ms", "measured_step_ms"):
        if out[key] is not None:
            cpu = f" ({out['emulator_cpu_step_ms']:.0f} ms of CPU time)" if "emulator_cpu_step_ms" in out else ""
            lines.append(f"{key.split('_')[0]} (forward + backward, this host): {out[key]:.0f} ms{cpu}")
    return out, lines, None


def kernels(chip: str, preset: str | None, pipeline: str, seq_len=None, batch_size=None, **_):
    preset = preset or "tiny"
    spec = _spec(preset, seq_len, batch_size, 1, pipeline)
    r = predict_step(spec, get_chip(chip))
    rows = [{k: v for k, v in row.items()} for row in r["kernels"]]
    lines = [f"{'kernel':12s} {'side':9s} {'evals':>6s} {'ms/eval':>8s} {'share':>6s} {'bound':9s} "
             f"{'GFLOP':>7s} {'MB':>7s} {'ws MB':>6s}"]
    for k in rows:
        lines.append(f"{k['kernel']:12s} {k['side']:9s} {k['evaluations']:6d} {k['eval_ms']:8.3f} "
                     f"{100 * k['share']:5.1f}% {k['bound']:9s} {k['flops'] / 1e9:7.3f} {k['bytes'] / 1e6:7.2f} "
                     f"{k['working_set_bytes'] / 1e6:6.2f}")
    costs = [(k.kind, k.cost) for k in programs.train_kernels(spec.dims, pipeline)]

    def png(path):
        from .plots import roofline_png

        roofline_png(path, costs, chip, f"{preset} training kernels ({pipeline}, S={spec.seq_len})")
    return {"chip": chip, "preset": preset, "pipeline": pipeline, "kernels": rows}, lines, png


def generate(chip: str, preset: str | None, model: str | None, measure: bool, repeat: int, **_):
    from ..models.config import config_from_dict
    from ..train.presets import get_preset

    weights = None
    if model:
        config, weights = load_for_bench(model)
        name = model
    else:
        name = preset or "tiny"
        config = config_from_dict(get_preset(name), name)
    r = predict_generate(config, get_chip(chip))
    out = {"chip": chip, "model": name, **{k: v for k, v in r.items() if k != "chip"},
           "emulator_prefill_ms": None, "emulator_decode_tokens_per_s": None}
    dev = _device(measure)
    if dev is not None:
        from .measure import time_generate

        pre, dec = time_generate(config, dev, weights=weights, repeat=repeat)
        key = _measured_key(dev)
        out[f"{key}_prefill_ms"], out[f"{key}_decode_tokens_per_s"] = pre.wall * 1e3, 1 / dec.wall
        out.update(_cpu_figures(dev, prefill_ms=pre.cpu * 1e3, decode_tokens_per_s=1 / max(dec.cpu, 1e-9)))
    lines = [f"{name} on {get_chip(chip).name}: predicted prefill (bucket {r['prefill_bucket']}) "
             f"{r['predicted_prefill_ms']:.2f} ms, decode {r['predicted_decode_tokens_per_s']:.0f} tokens/s "
             f"({r['predicted_decode_ms']:.2f} ms, cache tier {r['decode_tier']})"]
    if out.get("emulator_prefill_ms"):
        lines.append(f"emulator (this host): prefill {out['emulator_prefill_ms']:.0f} ms, "
                     f"decode {out['emulator_decode_tokens_per_s']:.1f} tokens/s")
    return out, lines, None


def load_for_bench(path: str):
    """(config, weights) through the project's loader: an HF folder, a .gguf, a llama2.c .bin,
    a checkpoint, or a training RUN folder (its latest checkpoint)."""
    from pathlib import Path

    from ..models.loading import load_model
    from ..train.checkpoint import latest_checkpoint

    p = Path(path)
    if p.is_dir() and (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise UsageError(f"--model {p}: a run folder with no checkpoints yet")
        p = ckpt
    config, weights, _ = load_model(p)
    return config, weights


def validate_cmd(**_):
    v = validate()
    lines = [f"{'figure':58s} {'chip':7s} {'published':>10s} {'predicted':>10s} {'error':>7s}  fit"]
    for r in v["figures"]:
        mark = "fitted" if r["fitted"] else ("held out" if r["kind"] != "microbenchmark" else "check")
        lines.append(f"{r['name'][:58]:58s} {r['chip']:7s} {r['published']:10.3f} {r['predicted']:10.3f} "
                     f"{100 * r['error']:+6.1f}%  {mark}")
    for b in v["breakdown_ranks"]:
        lines.append(f"{b['name']}: published order {', '.join(b['published_order'])}")
        lines.append(f"  predicted order {', '.join(b['predicted_order'])} (Spearman {b['spearman']:.2f})")
    lines.append(f"held out within ±{100 * AGREEMENT:.0f} %: {sum(_agrees(r) for r in _held(v))} of {len(_held(v))}; "
                 "notes (what the model does not know, which figures disagree):")
    lines += [f"- {r['name']} ({100 * r['error']:+.1f} %): {r['note']}" for r in v["figures"]
              if r["kind"] != "microbenchmark" and r["note"]]
    lines += [f"- {b['name']}: {b['note']}" for b in v["breakdown_ranks"] if b["note"]]
    return v, lines, None


AGREEMENT = 0.25  # the bar a held-out end-to-end figure is held to (docs/cost-model.md)


def _held(v: dict) -> list[dict]:
    return [r for r in v["figures"] if r["kind"] == "end_to_end"]


def _agrees(r: dict) -> bool:
    return abs(r["error"]) <= AGREEMENT


BENCHMARKS = {"peak": peak, "sram": sram, "kernels": kernels, "train": train, "generate": generate,
              "validate": validate_cmd}


def chips_table() -> tuple[dict, list[str]]:
    rows = {k: {"name": get_chip(k).name, **get_chip(k).values} for k in chip_names()}
    lines = [f"{k:7s} {v['name']}: conv {v['conv_fp16_flops'] / 1e12:.1f} / matmul {v['matmul_flops'] / 1e12:.1f} "
             f"TFLOP/s, int8 {v['int8_ops'] / 1e12:.1f} TOPS, dispatch {v['dispatch_s'] * 1e3:.3f} ms, "
             f"working set {v['working_set_bytes'] / 1e6:.2f} MB" for k, v in rows.items()]
    return {"chips": rows}, lines
