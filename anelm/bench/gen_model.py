"""Predicted prefill and decode: the generate pipeline's programs (anelm/generate) on a chip.

Per token, decode runs every layer's decode program once over the cache tier the position
reads (device_plan.py), and the host writes that tier of the cache into the inputs and reads
the new K/V back; the final norm and the vocabulary projection run on the CPU in fp32, a
matrix-vector product bound by reading V·D·4 bytes. Prefill runs each layer's bucket program
once, then the head for the last position.
"""

from __future__ import annotations

from ..generate.device_plan import plan_sizes
from ..chip.catalog import Chip
from ..chip.cost import eval_time, host_io_time
from .programs import decode_program, orion_decode_programs, prefill_program


def _head_s(vocab: int, d: int, chip: Chip, weight_bytes: int = 2) -> float:
    """Logits for one position on the CPU: a matvec, the larger of its arithmetic and its reads
    of the head, `weight_bytes` a weight (ours holds it as fp16, `generate/pipeline.py`; Orion
    reads fp32). Measured against tiling it on the device (`benchmarks/bench_head.py`)."""
    return max(2 * vocab * d / chip.cpu_sgemm_flops, weight_bytes * vocab * d / chip.cpu_dram_bytes_per_s)


def predict_generate(config, chip: Chip, prompt_tokens: int = 32, position: int = 128,
                     budget: int = 119) -> dict:
    """Prefill of `prompt_tokens` and one decode step at `position`, our pipeline's programs."""
    layers = config.num_hidden_layers
    plan = plan_sizes(layers, min(config.max_position_embeddings, 4096), budget)
    bucket, tier = plan.bucket(min(prompt_tokens, plan.prefill[-1])), plan.tier(min(position, plan.context - 1))
    dec, pre = decode_program(config, tier), prefill_program(config, bucket)
    head = _head_s(config.vocab_size, config.hidden_size, chip)
    t_dec = eval_time(dec, chip)
    decode_s = layers * (t_dec.total_s + host_io_time(dec, chip)) + head
    prefill_s = layers * (eval_time(pre, chip).total_s + host_io_time(pre, chip)) + head
    return {"chip": chip.key, "prefill_bucket": bucket, "decode_tier": tier,
            "predicted_prefill_ms": prefill_s * 1e3, "predicted_decode_ms": decode_s * 1e3,
            "predicted_decode_tokens_per_s": 1.0 / decode_s,
            "kernels": [{"kernel": f"decode_t{tier}", "evaluations": layers, "eval_ms": t_dec.total_s * 1e3,
                         "bound": t_dec.bound, "flops": dec.total_flops, "bytes": dec.bytes_moved}]}


def predict_orion_decode(chip: Chip, layers: int = 12, d: int = 768, vocab: int = 50257,
                         context: int = 64) -> float:
    """Orion's GPT-2 decode, seconds per token: two programs per layer on the device; attention
    over `context` positions, Wo and the logits on the CPU in fp32 (decode_ane.m in mechramc/Orion)."""
    device = sum(eval_time(k, chip).total_s + k.io_bytes / 4 * 8 / chip.cpu_vector_bytes_per_s  # fp32 I/O
                 for k in orion_decode_programs(d))
    attention = (2 * 2 * context * d * 4 + d * d * 4) / chip.cpu_dram_bytes_per_s  # K, V reads; Wo
    return layers * (device + attention) + _head_s(vocab, d, chip, weight_bytes=4)
