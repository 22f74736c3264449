"""One evaluation of a compiled program, as time on a chip.

The inputs are the compiler's cost annotation (`Artifact.meta["cost"]`, anelm/compiler/passes/
cost.py): FLOPs by unit, conv/matmul arithmetic grouped by the bytes its operands hold on chip,
weight and I/O bytes, the working set. The model is a roofline with a floor:

    t = dispatch + max(compute, memory)
    compute = Σ conv/conv_rate + Σ matmul/rate(op) + int8/int8_rate + vector
    rate(op) = matmul_flops × spill_slowdown  while the op's operands fit the working-set
               threshold, else matmul_flops (the published large-GEMM rooflines are measured
               past it; the drop past the threshold is the published ~30 %)
    memory  = (weight_bytes + io_bytes) / ane_bytes_per_s

    vector  = softmax/softmax_rate + reduce/reduce_rate + transcendental/elementwise_rate
              (elements; the rates are fitted on single-op microbenchmarks)

The ANE's vector path is far slower than its conv peak: a single-op program moves ~1.9 G
elements/s on M4 where a conv chain does 18.7 TFLOPS (ANEForge's M4 bandwidth roofline), and
its gelu runs at its relu's rate. Inside a program the model charges that rate only to the work
that reads whole rows (softmax, reductions) or evaluates a function (exp, sigmoid, pow, ...);
plain arithmetic and transposes/concats are taken to ride along with the neighbouring ops.
Charging them too at the single-op rate predicts maderix's forward kernels at 5x the published
device time (README, "Cost model"), so in-program arithmetic is evidently far cheaper than a
program of its own; how much cheaper no published figure says. Vector work is taken not to
overlap the matmuls of the same program.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import Chip

IO_BYTES = 6  # a host<->surface element as the host moves it: its fp32 side and its fp16 side


@dataclass(frozen=True)
class KernelCost:
    """What one evaluation asks: the annotation of one compiled program."""

    name: str
    flops: dict[str, int]
    ops: tuple[tuple[str, int, int], ...]
    weight_bytes: int
    io_bytes: int
    working_set_bytes: int
    vector_elements: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, artifact, name: str | None = None) -> "KernelCost":
        c = artifact.meta.get("cost")
        if not c:
            raise ValueError(f"program {name or artifact.meta.get('name')!r} has no cost annotation; "
                             "compile it with anelm.compiler.pipeline.compile_graph")
        return cls(name or artifact.meta.get("name", "kernel"), dict(c["flops"]),
                   tuple(tuple(o) for o in c["ops"]), int(c["weight_bytes"]), int(c["io_bytes"]),
                   int(c["working_set_bytes"]), tuple(sorted((c.get("vector_elements") or {}).items())))

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
    compute += vector_time(dict(k.vector_elements), chip)
    memory = k.bytes_moved / chip.ane_bytes_per_s
    total = chip.dispatch_s + max(compute, memory)
    return EvalTime(total, compute, memory, chip.dispatch_s, spilled)


def vector_time(elements: dict[str, int], chip: Chip) -> float:
    """Seconds of the vector path's work, by class (see the module doc)."""
    rate = {"transcendental": chip.ane_transcendental_per_s, "softmax": chip.ane_softmax_per_s,
            "reduce": chip.ane_reduce_per_s}
    return sum(n / rate[c] for c, n in elements.items() if c in rate)


def attainable_flops(intensity: float, chip: Chip, unit: str = "matmul") -> float:
    """The roofline: FLOP/s reachable at `intensity` FLOPs per DRAM byte (no dispatch)."""
    peak = {"conv": chip.conv_fp16_flops, "int8": chip.int8_ops}.get(unit, chip.matmul_flops * chip.spill_slowdown)
    return min(peak, intensity * chip.ane_bytes_per_s)


def host_io_time(k: KernelCost, chip: Chip) -> float:
    """The host's side of one evaluation's surfaces: every fp16 element converted from or to
    fp32 at the CPU's streaming rate."""
    return k.io_bytes / 2 * IO_BYTES / chip.cpu_vector_bytes_per_s
