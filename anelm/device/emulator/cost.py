"""The emulator's own time for one evaluation of a program, predicted from the compiler's cost
annotation (`Artifact.meta["cost"]`, compiler/passes/cost.py).

`anelm.chip.cost` predicts a chip. When the emulator is the device, what decides a choice
between programs (`generate.device_plan.choose_bucket`: a prompt's bucket, or a smaller one and
decode steps) is what the emulator takes, and it spends its time elsewhere: products at the
host's BLAS rate rather than the ANE's, every op result rounded to fp16 in a pass of its own,
weights streamed from host memory, and a fixed cost per call (the plan's steps, surfaces):

    seconds = (conv + matmul + int8 FLOPs)·r / FLOPS + vector elements·r · ELEMENT_S
              + weight bytes / BYTES_PER_S + CALL_S (a whole plan's, or a column plan's)

r is the fraction of the columns evaluated: a column-separable program read in one column
(`emulator.columns`: decode, 1 of strict's 16) does 1/16 of its arithmetic, but still reads its
weights whole. The constants are a least-squares fit (on relative error) to one pass of every
prefill bucket 16..1024 and decode tier 64..1024, as the emulator measured them (best of 3, one
x86-64 thread, the budget lifted so that every size is compiled) for SmolLM2-135M (30 layers,
576 wide), the GPT-2 124M shape (12 layers, 768) and a 2-layer tiny Llama: 25 of the 28
within 12 %, GPT-2's decode tiers 256-1024 measured 13-22 % slower than predicted. SmolLM2, a
pass over its 30 layers: buckets 16 → 61 ms, 32 → 110, 64 → 208, 128 → 382, 256 → 801,
512 → 1970, 1024 → 5182; a decode step 20-25 ms at every tier. Another host has other rates,
but they scale prefill and decode alike; their ratio, which the choice turns on, is a property
of the emulator's design more than of the machine.
"""

from __future__ import annotations

FLOPS = 1.17e11  # conv and matmul FLOPs per second (OpenBLAS sgemm and the fp16 tiles)
ELEMENT_S = 1.76e-9  # seconds per vector element (an op over it and its fp16 rounding)
BYTES_PER_S = 2.0e10  # weight bytes streamed from memory (fp16 patterns widened as read)
CALL_S = {"whole": 3.5e-4, "columns": 2.8e-4}  # per evaluation: the plan's steps and surfaces


def emulated_seconds(cost: dict, fraction: float = 1.0) -> float:
    """Predicted seconds of one evaluation of a program whose cost annotation is `cost`, of whose
    columns `fraction` are evaluated (below 1: a column plan, `Kernel(read_columns=...)`)."""
    flops = sum(cost["flops"].get(unit, 0) for unit in ("conv", "matmul", "int8"))
    elements = sum(cost.get("vector_elements", {}).values())
    return (flops * fraction / FLOPS + elements * fraction * ELEMENT_S + cost["weight_bytes"] / BYTES_PER_S
            + CALL_S["columns" if fraction < 1 else "whole"])
