"""`anelm quantize`: calibrate, quantize, write the folder, score both models, report.

The text (`--data`, else for W8 the built-in stories) is tokenized once: its first
`calib_tokens` ids calibrate, the next `eval_tokens` are held out and scored by the source
model and by the written folder read back, on the same device and profile.

W8A8 (quant/w8a8.py, quant/smooth.py). SmolLM2-135M's linear inputs reach 20-24 in a few
channels where the median channel stays under 3, its down projections' inputs 3,323 and 1,223 in
two channels (layer 11) against a median of 1.1, and past the kept channels they are heavy-tailed
by token: layer 29's down input, calibrated on the stories to 38, reaches 79 on the Apache
license, where 99 % of its values stay under 5.6. The plan keeps the outlier channels in fp16, may smooth, and may
quantize an input in two int8 products (its bulk at a fine scale, what that leaves at a coarse
one with 2x headroom), each knob chosen per model by perplexity on held-out calibration text.
Measured (SmolLM2, float32 CPU reference with the kernels' int8 roundings, 768 or 1024 tokens
of the built-in stories calibrating, the first 512 tokens of the Apache license scored, a text
the calibration never saw; unquantized 19.612):

    int8 weights alone                                           x1.005
    one scale, nothing kept / kept channels (the plan before)     x2.343 / x1.074
      which inputs cost it: qkv x0.993, o x1.008, gate/up x1.018, down x1.055 (alone in int8)
    scale clipped to 0.7 / 0.5 of the range                       x1.213 / x2.475
    SmoothQuant, every input, without / with the kept channels:
      α 0.3 x1.762 / x1.096, 0.5 x1.353 / x1.100, 0.6 x1.239 / x1.197, 0.7 x1.311 / x1.314
      kept channels and α 0.5 on one kind: o x1.053, norm inputs x1.066, down x1.110
    two products, kept channels, fine = range/127/8: coarse at the range x1.020; at 1.5x, 2x,
      3x x1.011, x0.994, x1.013; 2x and fine /4 x1.002; 2x with α 0.5 on norm and o x0.9995

On the emulator (tests/quant/test_quantize_real.py: 1024 story tokens, the choice made on their
last 256, the first 256 Apache tokens scored) `quantize` chose two products at 1/4, no smoothing:
17.746 -> 17.917, x1.0096 (W8 on the same: x0.9942).

So smoothing alone does not reach 3 %: down's error is in its tokens' tails, which one static
scale along the reduction cannot follow, and moving its channel ranges into the weights' columns
costs the int8 rows more (x1.110) than it saves. The second product does: its fine scale gives
the bulk 4-16x finer steps and the coarse one still holds every value; the headroom matters on
unseen text (calibrated on 768 Apache tokens and scored on 256 of the stories, the other way,
2x costs x1.019 against x1.015, within the noise). o's 1/s goes into v's rows, one factor per KV
group; a per-channel gain in the kernel (`QLinear.in_gain`) measured no better (o alone smoothed,
fine /4, 2x: α 0.4 x1.0080 against x1.0111 per group, α 0.7 x1.0118 against x1.0053), and would
need a tensor in the folder.

Per-channel activation scales: an int8 × int8 conv sums q_w[o, j]·q_x[j, t] over the input
channels j, and the result is dequantized by w_scale[o]·x_scale, so x's scale must be one
number along j for it to leave the sum; a scale per input channel is a factor on W's columns,
which is what smoothing is (measured above). x has no output axis (the weight's row scales are
per output channel already), and a scale per token t leaves the sum but depends on the token:
MIL's quantize takes its scale as a constant (one, or one per index of an axis), and one per
sequence position says nothing about the token there; a scale computed from each token at run
time is dynamic quantization, not static W8A8. Hence one static scale per product and tensor;
the second product is how a tensor gets two.
Cost: a W8A8 linear with two products runs its int8 conv twice on the same int8 weight (one
constexpr, read once): decode, bound by weight reads, barely moves; prefill's int8 compute doubles.

W8: the accumulator sums q·x before the row scale, so each linear's input is divided by a power
of two (`input_shift`) that keeps the largest calibrated sum under ACC_TARGET, 4x below the
accumulator limit of 32768: SmolLM2's layer 11 down projection sums to 566,000 unshifted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..models.errors import InputError
from .calibrate import calibrate
from .w8a8 import Choice, build, choose, held_part
from .report import DEFAULT_CHIP, folder_breakdown, larger_note, predicted_decode
from ..models.formats.quantized import (METHOD, InputQuant, LutQuant, QuantPlan, check_supported, linear_names, pack,
                               pack_lut, pack_w4, power_of_two_above, quantize_rows, refuse_quantized)

ACC_TARGET = 8192.0  # W8: largest calibrated unscaled sum after the shift
REPORT = "quantization_report.json"


def calibration(config, weights, calib, seq, progress=None, w8: bool = True) -> dict:
    """One calibration pass: {"qs": int8 rows of every linear, "chan": channel ranges, "sums":
    W8's largest unscaled sums (measured when `w8`), "fit": the ranges of the part W8A8's
    candidates are built from, "held": the ids they are scored on (w8a8.held_part), "seq"}.
    The int8 rows depend on the weights alone, so one pass can serve both schemes; W8A8 alone
    skips the sums (one more product per linear)."""
    names = linear_names(config)
    qs = {n: quantize_rows(weights[n + ".weight"]) for n in names}
    ints = {n: qs[n][0] for n in names} if w8 else None
    fit, held = held_part(list(calib), getattr(config, "bos_token_id", None))
    chan, sums = calibrate(config, weights, fit, seq, ints, progress)
    more, more_sums = calibrate(config, weights, held, seq, ints, progress) if held else ({}, {})
    whole = {n: np.maximum(c, more[n]) if n in more else c for n, c in chan.items()}
    sums = {n: max(v, more_sums.get(n, 0.0)) for n, v in sums.items()}
    return {"qs": qs, "chan": whole, "sums": sums, "fit": chan, "held": held, "seq": seq}


def plan_w8(config, weights, cal):
    inputs = {n: InputQuant(shift=power_of_two_above(cal["sums"][n] / ACC_TARGET)) for n in linear_names(config)}
    return cal["qs"], QuantPlan("w8", inputs, config.model_type), cal["chan"]


def plan_w8a8(config, weights, cal, progress=None):
    """(int8 rows, plan, channel ranges, the smoothed float weights the folder holds, what was
    chosen and measured): the candidates scored on the calibration's held-out part (`choose`),
    the winner built from the ranges of all of it."""
    if not cal["held"]:  # too little text to choose with (w8a8.held_part): the plainest plan
        choice, tried, source = Choice(), {}, None
    else:
        choice, tried, source = choose(config, weights, cal["fit"], cal["held"], cal["seq"], progress)
    sw, qs, inputs = build(config, weights, cal["chan"], choice)
    info = {**choice.to_dict(), "chosen_on_tokens": len(cal["held"]), "chosen_source_ppl": source,
            "candidates": tried}
    return qs, QuantPlan("w8a8", inputs, config.model_type), cal["chan"], sw, info


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
    report.update({k: qc[k] for k in ("block_size", "blocks", "group_size", "w8a8") if k in qc})  # W4's blocks' origin
    (folder / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_folder(out: Path, config, weights: dict, tok, scheme: str, calib, seq: int, progress=None, cal=None,
                 block_size: int | None = None, source: Path | None = None, group_size: int | None = None):
    """Calibrate on `calib` (or take `cal`, a `calibration` of it), quantize, and publish the
    folder at `out`: (folder, plan, channel ranges). W4 calibrates nothing (weights alone): its
    blocks come from `source` where that is a GGUF of 4-bit blocks (quant/w4.py)."""
    from ..train.export import _publish

    if scheme == "w4":
        return build_w4(out, config, weights, tok, block_size or 32, source, calib, seq)
    if scheme in ("lut4", "lut6"):
        return build_lut(out, config, weights, tok, int(scheme[3:]), calib, seq, group_size, block_size)
    cal = cal or calibration(config, weights, calib, seq, progress, w8=scheme == "w8")
    qc = {"quant_method": METHOD, "scheme": scheme, "bits": 8, "weights": "int8 per output channel, symmetric",
          "activations": "fp16"}
    if scheme == "w8a8":  # the folder holds the smoothed model: norm gains, v and up rows with 1/s
        qs, plan, chan, weights, qc["w8a8"] = plan_w8a8(config, weights, cal, progress)
        qc["activations"] = "int8 per tensor, static" + (f", in two products (bulk at 1/{qc['w8a8']['fine_ratio']} "
                                                        "of the scale)" if qc["w8a8"]["fine_ratio"] else "")
    else:
        qs, plan, chan = plan_w8(config, weights, cal)
    tensors = pack(config, weights, qs, plan)
    cfg = {**config.to_dict(), "torch_dtype": "float32", "quantization_config": qc}
    return _publish(out, lambda d: _write(d, cfg, tensors, tok)), plan, chan


def build_w4(out: Path, config, weights: dict, tok, block_size: int, source: Path | None = None, calib=None,
             seq: int = 512):
    """W4: blocks fitted on the input moments of `calib` (quant/w4.py) where it has MOMENT_TOKENS."""
    from ..train.export import _publish
    from .lut import input_moments
    from .w4 import MOMENT_TOKENS, TABLE_BLOCK, w4_blocks, w4_tables

    if any(weights[n + ".weight"].shape[1] % block_size for n in linear_names(config)) or block_size % 2:
        raise InputError(f"--block-size {block_size} does not divide every linear's inputs (hidden size "
                         f"{config.hidden_size}): expected an even divisor, such as 32")
    moments = input_moments(config, weights, calib, seq) if len(calib or ()) >= MOMENT_TOKENS else None
    blocks, how = w4_blocks(config, weights, block_size, source, moments)
    plan = QuantPlan("w4", {n: InputQuant() for n in blocks}, config.model_type, blocks)
    tables = w4_tables(config, weights, moments)
    tensors = pack_w4(config, weights, blocks, block_size, tables)
    cfg = {**config.to_dict(), "torch_dtype": "float32",
           "quantization_config": {"quant_method": METHOD, "scheme": "w4", "bits": 4, "block_size": block_size,
                                   "weights": f"uint4 blocks of {block_size} inputs, fp16 scales and offsets",
                                   "tables": f"uint4 blocks of {TABLE_BLOCK}, fp16 scales and offsets" if tables
                                   else f"int8 blocks of {block_size}, fp16 scales", "activations": "fp16",
                                   "blocks": how}}
    return _publish(out, lambda d: _write(d, cfg, tensors, tok)), plan, {}


def build_lut(out: Path, config, weights: dict, tok, bits: int, calib, seq: int, group: int | None, block: int | None):
    """LUT4/LUT6 (quant/lut.py): k-means tables counted by the calibration text's input moments;
    lut4's indices in GPTQ's order under its inputs' covariance (quant/gptq.py) from 512 tokens."""
    from ..train.export import _publish
    from .lut import DEFAULTS, choose_block, lut_tables

    tried, calib = None, list(calib or ())
    held = held_part(calib, getattr(config, "bos_token_id", None))[1]
    if bits == 4 and block is None and held:  # tables chosen on held-out calibration text (quant/lut.py)
        block, luts, tried = choose_block(config, weights, group or DEFAULTS[bits][0], held, seq, calib)
    group, block = group or DEFAULTS[bits][0], block or DEFAULTS[bits][1]
    if tried is None:
        luts = lut_tables(config, weights, bits, group, block, calib, seq)
    plan = QuantPlan(f"lut{bits}", {n: InputQuant() for n in luts}, config.model_type, luts)
    most = max(lq.block for lq in luts.values())
    cfg = {**config.to_dict(), "torch_dtype": "float32",
           "quantization_config": {"quant_method": METHOD, "scheme": f"lut{bits}", "bits": bits, "group_size": group,
                                   "block_size": most, "weights": f"uint{bits} indices packed, an fp16 table of "
                                   f"{2 ** bits} per {group} rows by up to {most} inputs (k-means)",
                                   "tables": "int8 blocks of 32, fp16 scales", "activations": "fp16",
                                   **({"chosen_on": {str(b): r for b, r in tried.items()}} if tried else {})}}
    return _publish(out, lambda d: _write(d, cfg, pack_lut(config, weights, luts), tok)), plan, {}


def _write(d: Path, cfg: dict, tensors: dict, tok) -> None:
    from ..models.formats.safetensors_io import save_safetensors

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
