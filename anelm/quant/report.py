"""What `quantize` says beside the perplexities: the predicted decode speed on the chip of the
source and of the quantized folder, and where the folder's bytes go.

Decode speed: one layer's decode program (kernels/decode.py) is compiled from layer 0's
weights as the generate pipeline holds them (fp16 matrices, or the plan's int8 / 4-bit blocks),
its cost annotation read (compiler/passes/cost.py: weight bytes as stored, 4-bit blocks at half
a byte a weight plus their scales and offsets) and timed on the chip (chip/cost.py), times the
layers, plus the head on the CPU: the figure `anelm bench generate` predicts for the fp16 model
(bench/gen_model.py), for these weights. A decode step reads every weight once: where the
chip is bound by those bytes, 4 bits pay. SmolLM2-135M at the default context (one decode tier
of 4096 positions) is not: a layer's program computes for 565 µs (attention's vector work over
the tier) and reads its weights in 90 µs at fp16, 47 µs at W4, so both predict 35 tokens/s;
the report gives the weight reads per token beside the speed (`weight_read_ms`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

DEFAULT_CHIP = "m4"  # as `anelm bench` off a Mac
POSITION = 128  # the cache position of the predicted step (bench/gen_model.py's default)


def predicted_decode(config, weights: dict, plan=None, chip_key: str = DEFAULT_CHIP) -> tuple[float, float]:
    """(predicted decode tokens/s, ms a token spends reading the layers' weights) on the chip for
    `weights` (float32, HF names), held as the plan says (None: fp16)."""
    from ..chip.catalog import get_chip
    from ..chip.cost import KernelCost, eval_time, host_io_time
    from ..chip.profile import STRICT
    from ..compiler.pipeline import compile_graph
    from ..generate.device_plan import plan_sizes
    from ..kernels.decode import decode_layer
    from ..kernels.int8 import plan_layer
    from ..kernels.layers import layer_params, layer_shape
    from ..models.names import layer_weights

    chip, s, n = get_chip(chip_key), layer_shape(config), config.num_hidden_layers
    sizes = plan_sizes(n, min(config.max_position_embeddings, 4096), 119)
    tier = sizes.tier(min(POSITION, sizes.context - 1))
    raw = layer_weights(config, weights, 0)
    params = plan_layer(plan, 0, s, raw) if plan is not None else layer_params(s, raw)
    art = compile_graph(decode_layer(s, params, tier, s.family.rotary, columns=STRICT.spatial_multiple_of), STRICT)
    k = KernelCost.of(art)
    head = 2 * config.vocab_size * config.hidden_size / min(chip.cpu_sgemm_flops, chip.cpu_dram_bytes_per_s)  # fp16 on the CPU
    secs = n * (eval_time(k, chip).total_s + host_io_time(k, chip)) + head
    return 1.0 / secs, n * k.weight_bytes / chip.ane_bytes_per_s * 1e3


def folder_breakdown(folder: Path) -> dict[str, int]:
    """Bytes of the folder by what holds them: int8/4-bit weights, fp16 scales and offsets,
    float32 tensors (norms, any table left unquantized), and the other files (tokenizer, config)."""
    out = {"quantized weights": 0, "scales and offsets": 0, "float32 tensors": 0, "other files": 0}
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            out["other files"] += f.stat().st_size if f.is_file() else 0
            continue
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        kind = {"I8": "quantized weights", "U8": "quantized weights", "F16": "scales and offsets"}
        for t in (t for k, t in header.items() if k != "__metadata__"):
            out[kind.get(t["dtype"], "float32 tensors")] += t["data_offsets"][1] - t["data_offsets"][0]
    return out


def larger_note(r: dict) -> str | None:
    """The line that says why the folder is larger than its source, when it is."""
    if r["file_bytes"] <= r.get("source_file_bytes", r["file_bytes"]):
        return None
    mib, b = (lambda n: f"{n / 2**20:.1f} MiB"), r.get("file_breakdown") or {}  # noqa: E731
    parts, tensors = ", ".join(f"{k} {mib(v)}" for k, v in b.items() if v), sum(b.values()) - b.get("other files", 0)
    if r["scheme"] in ("w8", "w8a8"):
        why = ("the source stores fewer than 8 bits a weight (a 4-bit GGUF, say), the folder int8 weights "
               "(and its norms and embedding in float32)")
    elif b and tensors <= r["source_file_bytes"]:  # SmolLM2's Q4_1 GGUF: the same blocks, byte for byte
        why = (f"its tensors take {mib(tensors)}, no more than the source's whole file; the rest is the tokenizer "
               f"and config files ({mib(b['other files'])}), which a GGUF keeps packed in its header")
    elif r["scheme"] == "w4":
        why = "the source packs its weights tighter than 4-bit blocks with an fp16 scale and offset each"
    else:  # lut4/lut6
        why = f"the source packs its weights tighter than {r['scheme'][3:]}-bit indices with fp16 tables"
    return (f"anelm: note: the folder takes {r['file_bytes'] / 2**20:.0f} MiB on disk, more than its source's "
            f"{r['source_file_bytes'] / 2**20:.0f} MiB: {why}" + (f" ({parts})" if parts else ""))
