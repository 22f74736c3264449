"""`anelm quantize`: calibrate, quantize, write the folder, score both models, report.

The text (`--data`, else for W8 the built-in stories) is tokenized once: its first
`calib_tokens` ids calibrate, the next `eval_tokens` are held out and scored by the source
model and by the written folder read back, on the same device and profile.

Activation outliers (W8A8). SmolLM2-135M's linear inputs reach 20-24 in a few channels where the
median channel stays under 3, and its down projections' inputs reach 3,323 and 1,223 in two
channels (layer 11) against a median of 1.1. One int8 scale for such a tensor gives every
ordinary channel a step of 26, so they round to 0. We keep the channels whose calibrated range
exceeds OUTLIER_RATIO × the median channel's out of int8 (at most 1/MAX_KEEP_FRACTION of them):
they go through a small fp16 side product (kernels/int8.py), and the rest get one scale from
their own range. We chose this over SmoothQuant's migration (x/s into int8, W·diag s into the
int8 rows, s_j = max|x_j|^α / max|W_j|^(1-α)) because it measures better: SmolLM2, 256 tokens
of the Apache license calibrating and the next 256 scored, both done in float32 on the CPU
reference with the int8 roundings the kernels apply, perplexity 21.671 unquantized, x1.0102 with
the outliers kept, x1.223 migrated at α = 0.5, x1.040 at α = 0.8, x2.265 with neither. Large α
moves the outliers into the weights' rows, whose int8 then loses the ordinary columns instead.
The migration also has to put 1/s into the producing op or a multiply (for the attention output,
through v's rows, shared per KV group); the kept channels cost a product of k/in of the main one.

W8: the accumulator sums q·x before the row scale, so each linear's input is divided by a power
of two (`input_shift`) that keeps the largest calibrated sum under ACC_TARGET, 4x below the
limit of 32768 (strict §2.9): SmolLM2's layer 11 down projection sums to 566,000 unshifted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..models.errors import InputError
from .calibrate import calibrate
from .report import DEFAULT_CHIP, folder_breakdown, larger_note, predicted_decode
from ..models.quantized import (METHOD, QMAX, InputQuant, LutQuant, QuantPlan, check_supported, linear_names, pack,
                               pack_lut, pack_w4, power_of_two_above, quantize_rows, refuse_quantized)

ACC_TARGET = 8192.0  # W8: largest calibrated unscaled sum after the shift
OUTLIER_RATIO = 8.0  # W8A8: a channel whose range exceeds this × the median channel's stays fp16
MAX_KEEP_FRACTION = 16  # ... at most in/16 channels per input
REPORT = "quantization_report.json"


def outliers(chan: np.ndarray) -> np.ndarray:
    """The input channels kept out of int8: the largest ranges above the ratio, capped."""
    order = np.argsort(chan)[::-1]
    over = int((chan > OUTLIER_RATIO * np.median(chan)).sum())
    return np.sort(order[:min(over, len(chan) // MAX_KEEP_FRACTION)])


def calibration(config, weights, calib, seq, progress=None, w8: bool = True):
    """One calibration pass: (int8 rows of every linear, channel ranges, W8's largest unscaled
    sums, measured when `w8`). The int8 rows depend on the weights alone, so one pass can serve
    both schemes; W8A8 alone skips the sums (one more product per linear)."""
    names = linear_names(config)
    qs = {n: quantize_rows(weights[n + ".weight"]) for n in names}
    chan, sums = calibrate(config, weights, calib, seq, {n: qs[n][0] for n in names} if w8 else None, progress)
    return qs, chan, sums


def plan_w8(config, weights, cal):
    qs, chan, sums = cal
    inputs = {n: InputQuant(shift=power_of_two_above(sums[n] / ACC_TARGET)) for n in linear_names(config)}
    return qs, QuantPlan("w8", inputs, config.model_type), chan


def plan_w8a8(config, weights, cal):
    _, chan, _ = cal
    qs, inputs = {}, {}
    for n in linear_names(config):
        keep = outliers(chan[n])
        rest = np.delete(chan[n], keep)
        w = weights[n + ".weight"].copy()
        w[:, keep] = 0.0  # those columns go through the fp16 side product
        qs[n] = quantize_rows(w)
        inputs[n] = InputQuant(1.0, max(float(rest.max()), 1e-4) / QMAX, keep)
    return qs, QuantPlan("w8a8", inputs, config.model_type), chan


def device_bytes(weights: dict, plan: QuantPlan | None = None) -> int:
    """Weight bytes at 1 B per int8 value and 2 B per fp16 value (scales, outlier columns, the
    rest), as the device and its fp16 blobs hold them."""
    total = 2 * sum(int(v.size) for v in weights.values())
    if plan is None:
        return total
    for n, bq in plan.blocks.items():  # W4: half a byte a weight, fp16 scales, fp16 or uint4 offsets
        if isinstance(bq, LutQuant):  # LUT: bits/8 a weight, fp16 tables
            total += -2 * bq.indices.size + -(-bq.indices.size * bq.bits // 8) + 2 * bq.lut.size
            continue
        nb = bq.scale.size
        total += -2 * bq.data.size + bq.data.size // 2 + 2 * nb + (2 * nb if bq.offset.dtype == np.float16 else -(-nb // 2))
    if plan.blocks:
        return total
    for n, iq in plan.inputs.items():
        out, inp = weights[n + ".weight"].shape
        k = 0 if iq.keep is None else len(iq.keep)
        total += -2 * out * inp + out * (inp - k) + 2 * out * k + 2 * out  # int8 + fp16 columns + row scales
    return total


def split_text(tok, text: str, calib_tokens: int, eval_tokens: int) -> tuple[list[int], list[int]]:
    """(calibration ids, held-out ids). Where the tokenizer starts a text with BOS, the held-out
    ids start with it too (BOS and eval_tokens - 1 ids), so they are scored as a text is read:
    Gemma 3 puts its attention sink on BOS, and without it int8 weights move its perplexity by
    noise-like amounts (270M, 256 held-out tokens of the Apache license, float32 CPU reference:
    x0.968 without BOS, x0.996 with it). Tokenizers that add no BOS (SmolLM2's, GPT-2's) are
    scored as before."""
    ids = tok.encode(text)
    bos = ids[:1] if ids and tok.bos_id is not None and ids[0] == tok.bos_id else []
    calib = ids[:calib_tokens]
    held = bos + ids[calib_tokens:calib_tokens + eval_tokens - len(bos)]
    if len(held) < 2:
        raise InputError(f"the text has {len(ids)} tokens: expected more than --calib-tokens "
                         f"({calib_tokens}) + 2, the rest being held out for scoring")
    return calib, held


def quantize_command(model: str, out: str, scheme: str, text: str, calib_tokens: int, eval_tokens: int,
                     device: str = "auto", progress: bool | None = None, profile=None, block_size: int | None = None,
                     group_size: int | None = None) -> dict:
    """Everything `anelm quantize` does; returns the report. `profile`: the devices' chip
    profile (a ChipProfile; None: ANELM_PROFILE, else strict)."""
    from ..generate.perplexity import perplexity
    from ..generate.runner import make_runner
    from ..models.loading import load_model
    from ..train.export import _check_destination

    refuse_quantized(model, "quantize")
    _check_destination(Path(out))
    config, weights, tok = load_model(model)
    check_supported(config)
    if tok is None:
        raise InputError(f"no tokenizer found for {model}; quantize needs the model's tokenizer")
    calib, held = split_text(tok, text, calib_tokens, eval_tokens)
    seq = min(config.max_position_embeddings, 512)
    folder, plan, chan = build_folder(Path(out), config, weights, tok, scheme, calib, seq, progress,
                                      block_size=block_size, source=Path(model), group_size=group_size)
    source_ppl = perplexity(make_runner(config, weights, device, max_context=seq, profile=profile), held, seq,
                            progress).ppl
    qconfig, qweights, _ = load_model(folder)
    quantized_ppl = perplexity(make_runner(qconfig, qweights, device, max_context=seq, profile=profile), held, seq,
                               progress).ppl
    report = {"scheme": scheme, "source_ppl": source_ppl, "quantized_ppl": quantized_ppl, "eval_tokens": len(held),
              "source_bytes": device_bytes(weights), "quantized_bytes": device_bytes(qweights, plan),
              "max_activation": float(max(float(c.max()) for c in chan.values())) if chan else None,
              "ppl_ratio": quantized_ppl / source_ppl, "calib_tokens": len(calib),
              "outlier_channels": int(sum(0 if iq.keep is None else len(iq.keep) for iq in plan.inputs.values())),
              "file_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
              "source_file_bytes": _stored_bytes(Path(model))}
    report["file_breakdown"] = folder_breakdown(folder)
    (src, src_ms), (got, got_ms) = predicted_decode(config, weights), predicted_decode(qconfig, qweights, plan)
    report["predicted_decode_tokens_per_s"] = {"chip": DEFAULT_CHIP, "source": src, "quantized": got,
                                               "weight_read_ms": {"source": src_ms, "quantized": got_ms}}
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    report.update({k: qc[k] for k in ("block_size", "blocks", "group_size") if k in qc})  # W4's blocks' origin
    (folder / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_folder(out: Path, config, weights: dict, tok, scheme: str, calib, seq: int, progress=None, cal=None,
                 block_size: int | None = None, source: Path | None = None, group_size: int | None = None):
    """Calibrate on `calib` (or take `cal`, a `calibration` of it), quantize, and publish the
    folder at `out`: (folder, plan, channel ranges). W4 calibrates nothing (weights alone): its
    blocks come from `source` where that is a GGUF of 4-bit blocks (quant/w4.py)."""
    from ..train.export import _publish

    if scheme == "w4":
        return build_w4(out, config, weights, tok, block_size or 32, source)
    if scheme in ("lut4", "lut6"):
        return build_lut(out, config, weights, tok, int(scheme[3:]), calib, seq, group_size, block_size)
    cal = cal or calibration(config, weights, calib, seq, progress, w8=scheme == "w8")
    qs, plan, chan = (plan_w8a8 if scheme == "w8a8" else plan_w8)(config, weights, cal)
    tensors = pack(config, weights, qs, plan)
    cfg = {**config.to_dict(), "torch_dtype": "float32",
           "quantization_config": {"quant_method": METHOD, "scheme": scheme, "bits": 8,
                                   "weights": "int8 per output channel, symmetric",
                                   "activations": "int8 per tensor, static" if scheme == "w8a8" else "fp16"}}
    return _publish(out, lambda d: _write(d, cfg, tensors, tok)), plan, chan


def build_w4(out: Path, config, weights: dict, tok, block_size: int, source: Path | None = None):
    from ..train.export import _publish
    from .w4 import w4_blocks

    if any(weights[n + ".weight"].shape[1] % block_size for n in linear_names(config)) or block_size % 2:
        raise InputError(f"--block-size {block_size} does not divide every linear's inputs (hidden size "
                         f"{config.hidden_size}): expected an even divisor, such as 32")
    blocks, how = w4_blocks(config, weights, block_size, source)
    plan = QuantPlan("w4", {n: InputQuant() for n in blocks}, config.model_type, blocks)
    tensors = pack_w4(config, weights, blocks, block_size)
    cfg = {**config.to_dict(), "torch_dtype": "float32",
           "quantization_config": {"quant_method": METHOD, "scheme": "w4", "bits": 4, "block_size": block_size,
                                   "weights": f"uint4 blocks of {block_size} inputs, fp16 scales and offsets",
                                   "tables": f"int8 blocks of {block_size}, fp16 scales", "activations": "fp16",
                                   "blocks": how}}
    return _publish(out, lambda d: _write(d, cfg, tensors, tok)), plan, {}


def build_lut(out: Path, config, weights: dict, tok, bits: int, calib, seq: int, group: int | None, block: int | None):
    """LUT4/LUT6 (quant/lut.py): k-means tables counted by the calibration text's input moments."""
    from ..train.export import _publish
    from .lut import DEFAULTS, input_moments, lut_tables

    group, block = group or DEFAULTS[bits][0], block or DEFAULTS[bits][1]
    luts = lut_tables(config, weights, bits, group, block, input_moments(config, weights, calib, seq))
    plan = QuantPlan(f"lut{bits}", {n: InputQuant() for n in luts}, config.model_type, luts)
    most = max(lq.block for lq in luts.values())
    cfg = {**config.to_dict(), "torch_dtype": "float32",
           "quantization_config": {"quant_method": METHOD, "scheme": f"lut{bits}", "bits": bits, "group_size": group,
                                   "block_size": most, "weights": f"uint{bits} indices packed, an fp16 table of "
                                   f"{2 ** bits} per {group} rows by up to {most} inputs (k-means)",
                                   "tables": "int8 blocks of 32, fp16 scales", "activations": "fp16"}}
    return _publish(out, lambda d: _write(d, cfg, pack_lut(config, weights, luts), tok)), plan, {}


def _write(d: Path, cfg: dict, tensors: dict, tok) -> None:
    from ..models.safetensors_io import save_safetensors

    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_safetensors(d / "model.safetensors", tensors, metadata={"format": "pt"})
    tok.save(d)


def summary(r: dict) -> str:
    speed = r.get("predicted_decode_tokens_per_s")
    return (f"{r['scheme']}: perplexity {r['source_ppl']:.4f} -> {r['quantized_ppl']:.4f} "
            f"(x{r['ppl_ratio']:.4f}) on {r['eval_tokens']} held-out tokens; weights "
            f"{r['source_bytes'] / 2**20:.1f} MiB -> {r['quantized_bytes'] / 2**20:.1f} MiB"
            + (f" (folder {r['file_bytes'] / 2**20:.1f} MiB)" if "file_bytes" in r else "")
            + (f"; predicted decode on {speed['chip']}: {speed['source']:.0f} -> {speed['quantized']:.0f} tokens/s "
               f"(weight reads {speed['weight_read_ms']['source']:.2f} -> {speed['weight_read_ms']['quantized']:.2f} "
               "ms a token)" if speed else "")
            + (f"; largest calibrated activation {r['max_activation']:.1f}" if r.get("max_activation") else ""))


def print_summary(r: dict) -> None:
    print(summary(r), file=sys.stderr)
    note = larger_note(r)  # a 4-bit GGUF grows as int8: said, not hidden
    if note:
        print(note, file=sys.stderr)


def _stored_bytes(model: Path) -> int:
    """The bytes of a model as stored: its file, or its folder's files (safetensors, GGUF)."""
    if model.is_file():
        return model.stat().st_size
    return sum(f.stat().st_size for f in model.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".gguf"))
