"""Size is enforced (STYLE.md §6, tinygrad's sz.py): small modules, and a budget for the package.

Lines are counted as in the files (docstrings and comments included), so the budget is honest.
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "anelm"
MAX_MODULE_LINES = 400
# 20000 until this round; grown by what each capability needed: LoRA (issue 14: adapters, the
# LoRA and GPT-2 training steps, finetune), the kernel cache and the MIL fast reader (issue 18),
# column-separable evaluation and the reject table (issue 13), the reference static programs (16);
# then the fp16-resident decode (18), LoRA dropout (14), Orion's and maderix's first programs (16),
# the cold compile's one-pass fp16 fold and one-match statements, the program store that lets a
# warm generation skip building its programs, decode's bound one-column steps (18), the kernel cache's
# entries that keep what the build derived, the remembered source fingerprint and the kernel
# cache's count that spares a listing per put, the fold into blob payloads, the CPU's own fp16
# conversions both ways, the parser's one-match statement, the ordered graph's skipped sort.
# + 11: quantize for Gemma 3 (int8 layers ask the family for their linears and unit gains).
# + 140: the real backend readied for a Mac (issue 28: source-keyed self-test verdicts, doctor
# probes restarted past a crash, atomic shared compile folders, a recompile when a load fails).
# + 196: issue 28's user-facing fixes (chat's Ctrl-C stops a reply, progress lines without a
# terminal, the unwritable-cache notice, flags checked before a model loads, CPU-time baselines).
# + 888: Gemma 3 and the architecture registry (issue 27: its config, CPU reference, layer family,
# training step and windowed attention kernels, the ring KV cache, the chunked classifier loss,
# per-architecture declarations), the trainer's checkpoint on Ctrl-C, atomic writes' modes and
# stray sweep, the quantize size note, the truncated-GGUF message (issue 28).
# + 146: int8 on the emulator at fp16's pace (issue 28: W8 register tiles and a bound int8 decode
# product, int8 layers in the program store).
# + 1: the review of that round (one per-layer RoPE table for the reference, runner and step).
# + 506: instruction data (issue 29: JSONL records to counted-token examples, first-fit packing and
# the epoch batcher, `perplexity --data FILE.jsonl`, chat templates compiled once).
# + 166: response_format by constrained decoding (issue 30: llguidance's masks as a logits processor).
# + 383: the generation library a server sits on (issue 30: SamplingOptions, stream_generate,
# the engine, History and the prompt cache moved out of the CLI).
# + 722: anelm serve (issue 30: the OpenAI protocol, the device worker, the HTTP layer, the CLI,
# every program built before serving).
# + 139: rope scaling in one table for every family (issue 31: linear, dynamic, yarn, llama3 and
# longrope's frequencies against HF's, YaRN's attention factor folded into the score scale).
# + 116: Qwen2 / Qwen2.5 (issue 31: its module, GGUF YaRN keys, q/k/v and o biases in the training step).
# + 39: Llama 3.x from GGUF (issue 31: llama.cpp's rope_freqs divisors back to HF's llama3 parameters).
# + 77: Mistral (issue 31: its module; a `llama` GGUF claimed by the window key).
# + 96: HF repo ids for --model (issue 31: the HF cache through huggingface_hub, offline too).
# + 92: SmolLM3 (issue 31: its module, RoPE's `none` for layers without it, per-layer RoPE tables in
# the Llama training step and CPU reference, which Gemma's step and reference had alone).
# + 185: the prefill policy (issue 30: a prompt's bucket, or a smaller one and decode steps, by the
# device's predicted times; prefill slots bound on first use; a server's slots by the mean first token).
# + 6: the chip catalog and one program's cost moved from bench/ to chip/ (generation reads them).
# + 81: constexpr_blockwise_shift_scale (issue 34: the iOS 18 op, its builder, packed sub-byte sizes).
# + 429: anelm quantize --scheme w4 (issue 34: 4-bit blocks, the folder, GGUF Q4_0/Q4_1 blocks as they are, the
# kernels' blockwise op, the report's predicted decode and byte breakdown).
# + 374: Phi-3 (its module: fused qkv/gate_up split at load, partial rotation, LongRoPE per sequence on
# the CPU; LoRA on fused modules with a shared A in the adapters and the LoRA step; GGUF phi3).
# + 12: 4-bit BLOBFILE payloads packed and unpacked as nibble pairs (issue 34: SmolLM2's programs built 7 s faster).
# + 35: the doctor's op.constexpr_blockwise_shift_scale probe (issue 34: 4-bit weights on a user's Mac).
# + 11: W4's cost annotation and the report's weight reads per token (issue 34).
# + 466: training ahead of maderix (issue 32: gradient accumulation inside the dW sgemm, the
# classifier on the device in vocabulary tiles, its placement and cost, `--head-on`).
# + 56: Phi-3's LongRoPE on the device (generate/longrope.py: the runner that switches its tables per sequence).
# + 28: the prompt cache resumes only where it pays, and prefill slots take halfway sizes (issue 30).
# + 33: the SwiGLU backward inside ffn_down_dx on the ANE (issue 32: Dims.swiglu_dx, the cost model's anelm_spec).
# + 40: a micro-step's dW beside the next one's forward, and maderix's predicted step beside ours in `bench train` (issue 32).
# + 5: the W4 kernel form in kernels/int8.py's module doc (issue 34).
# + 79: several tokens in one decode pass pair (issue 30: generate/device_passes.py, per-column decode
# masks, batched evaluation; the passes moved out of pipeline.py).
# + 7: GGUF's gpt-4o pre-tokenizer (issue 31: Phi-4-mini's GGUF files).
# + 57: constexpr_lut_to_dense in the op table, its builder method, constexpr operands past rank 4 (issue 34).
# + 38: an evaluation of some outputs runs only their steps (issue 30: a decode chunk's first pass).
# + 1: Qwen2's and SmolLM3's optional window on some layers, one implementation in models/config.py.
# + 246: quantize --scheme lut4/lut6 (issue 34: quant/lut.py, LutQuant, the LUT kernels and CLI flags).
# + 36: doctor's op.constexpr_lut_to_dense probe (issue 34).
# + 2: quant/lut.py's Lloyd iterates only the tiles still moving (ba8d341).
# + 1: ir/builder.py's LUT dtype error within 120 columns.
# + 2: quantize's larger-than-source note gives LUT's reason (issue 34).
# + 1: the step model asks the family whether the SwiGLU backward runs on the device.
# + 5: W4 and LUT layers in the program store (issue 34).
MAX_PACKAGE_LINES = 30661


def line_counts() -> dict[str, int]:
    return {str(p.relative_to(PACKAGE)): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_is_small():
    big = {name: n for name, n in line_counts().items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them): {big}"


def test_package_stays_within_its_line_budget():
    total = sum(line_counts().values())
    assert total <= MAX_PACKAGE_LINES, f"anelm/ has {total} lines; budget {MAX_PACKAGE_LINES}"
