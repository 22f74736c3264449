"""One evaluation of a compiled program, as time on a chip.

The inputs are the compiler's cost annotation (`Artifact.meta["cost"]`, anelm/compiler/passes/
cost.py): FLOPs by unit, conv/matmul arithmetic grouped by the bytes its operands hold on chip,
weight and I/O bytes, the working set. The model is a roofline with a floor:

    t = dispatch + max(compute, memory)
    compute = Σ conv/conv_rate + Σ matmul/rate(op) + vector/matmul_rate + int8/int8_rate
    rate(op) = matmul_flops × spill_slowdown  while the op's operands fit the working-set
               threshold, else matmul_flops (the published large-GEMM rooflines are measured
               past it; the drop past the threshold is the published ~30 %)
    memory  = (weight_bytes + io_bytes) / ane_bytes_per_s

Vector work (elementwise, softmax, reductions) is charged at the matmul rate: no published
figure separates the ANE's vector throughput, and it is a few percent of a transformer's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chips import Chip


@dataclass(frozen=True)
class KernelCost:
    """What one evaluation asks: the annotation of one compiled program."""

    name: str
    flops: dict[str, int]
    ops: tuple[tuple[str, int, int], ...]
    weight_bytes: int
    io_bytes: int
    working_set_bytes: int

    @classmethod
    def of(cls, artifact, name: str | None = None) -> "KernelCost":
        c = artifact.meta.get("cost")
        if not c:
            raise ValueError(f"program {name or artifact.meta.get('name')!r} has no cost annotation; "
                             "compile it with anelm.compiler.pipeline.compile_graph")
        return cls(name or artifact.meta.get("name", "kernel"), dict(c["flops"]),
                   tuple(tuple(o) for o in c["ops"]), int(c["weight_bytes"]), int(c["io_bytes"]),
                   int(c["working_set_bytes"]))

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.io_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved from DRAM: the roofline's x axis."""
        return self.total_flops / max(self.bytes_moved, 1)


@dataclass(frozen=True)
class EvalTime:
    total_s: float
    compute_s: float
    memory_s: float
    dispatch_s: float
    spilled_flops: int  # arithmetic of ops whose operands exceed the working-set threshold

    @property
    def bound(self) -> str:
        body = max(self.compute_s, self.memory_s)
        if self.dispatch_s >= body:
            return "dispatch"
        return "compute" if self.compute_s >= self.memory_s else "memory"


def eval_time(k: KernelCost, chip: Chip) -> EvalTime:
    fast_matmul = chip.matmul_flops * chip.spill_slowdown
    compute, spilled = 0.0, 0
    for unit, flops, operand_bytes in k.ops:
        over = operand_bytes > chip.working_set_bytes
        if unit == "conv":
            compute += flops / chip.conv_fp16_flops * (chip.spill_slowdown if over else 1.0)
        elif unit == "int8":
            compute += flops / chip.int8_ops * (chip.spill_slowdown if over else 1.0)
        else:
            compute += flops / (chip.matmul_flops if over else fast_matmul)
        spilled += flops if over else 0
    compute += k.flops.get("vector", 0) / fast_matmul
    memory = k.bytes_moved / chip.ane_bytes_per_s
    total = chip.dispatch_s + max(compute, memory)
    return EvalTime(total, compute, memory, chip.dispatch_s, spilled)


def attainable_flops(intensity: float, chip: Chip, unit: str = "matmul") -> float:
    """The roofline: FLOP/s reachable at `intensity` FLOPs per DRAM byte (no dispatch)."""
    peak = {"conv": chip.conv_fp16_flops, "int8": chip.int8_ops}.get(unit, chip.matmul_flops * chip.spill_slowdown)
    return min(peak, intensity * chip.ane_bytes_per_s)
