"""Where the classifier runs (`--head-on`, docs/training.md), and what each place costs on a chip.

The classifier with its loss is the largest single piece of a step's CPU work (Stories110M:
a 32000 × 768 head, 35 ms of a predicted 133 ms micro-step on the M4; Qwen3-0.6B's 151,936 rows:
194 ms of 621). `cpu` runs it as `cpu_ops.head_loss`; `ane` in vocabulary tiles on the device
(`head_device.py`), the CPU joining the tiles. The times below are the cost model's rules
(bench/step_model.py charges a step with them, and `auto` reads them):

    cpu   on the main thread: logits and dx, two sgemm at the chip's `cpu_sgemm_flops`, and a
          softmax pass per logit at `cpu_exp_s`; on the dW worker, dW's sgemm
    ane   on the main thread: per tile and sequence the kernel's evaluation (chip.cost), its
          surfaces converted by the CPU (x in, dx, e, max and sum out; as every kernel's I/O),
          and the CPU's join: dx += c_t·g_t over the tiles (read 2, write 1 fp32); on the dW
          worker, dW's sgemm and each tile's x·c_t; once per update, every tile's weights
          restaged (as the layers' weights are)
    gpu   on the main thread: xf copied into torch's buffer and dx out of it; on the GPU, in the
          step's path: logits and dx (two GEMMs at the chip's `gpu_sgemm_flops`) and the softmax's
          passes over the logits (GPU_SOFTMAX_BYTES each, at `gpu_bytes_per_s`); on the GPU beside
          the ANE's backward: dW's GEMM; on the dW worker: dW copied into the gradient buffer;
          once per update, the head's weights copied to the GPU

`auto` takes the place with the lowest predicted time per micro-step on the chip the run trains
on: this Mac's (the table's M4 elsewhere), `gpu` among them where the chip's GPU figures are
published and torch finds a GPU. On the emulator the CPU: the emulator runs a
kernel's products on the same host BLAS as the CPU classifier's, in fp16 with a rounding pass
after every op, so on this machine the device head does the CPU head's work and more.
"""

from __future__ import annotations

from functools import lru_cache

from ...chip.cost import IO_BYTES, KernelCost, eval_time
from ...errors import UsageError
from .cpu_ops import matmul_flops
from .head_device import tile_rows, tiles
from .head_torch import gpu_device
from ..settings import HEAD_PLACES as PLACES

F32 = 4
# the softmax cross-entropy's passes over [V, N] fp32 logits on the GPU (head_torch.TorchHead):
# max (read), exp (read, write), sum (read), scale and the one-hot term (read, write)
GPU_SOFTMAX_BYTES = 6 * F32


@lru_cache(maxsize=32)
def tile_cost(d: int, s: int, rows: int) -> KernelCost:
    """The compiled tile kernel's cost annotation (compiled on the host, nothing on a device)."""
    import warnings

    from ...compiler.pipeline import compile_graph
    from ...kernels.classifier import classifier_tile

    with warnings.catch_warnings():  # a tile past the working set is priced, not refused
        warnings.simplefilter("ignore")
        return KernelCost.of(compile_graph(classifier_tile(d, s, rows)), f"classifier_{rows}")


def head_seconds(place: str, vocab: int, d: int, s: int, batch: int, chip, cross_entropy_s: float) -> dict:
    """{"main", "dw", "restage", "device", "io", "gpu", "gpu_beside"} seconds of one micro-step's
    classifier (restage: per update) at `place`, for sequences of `s` columns, `batch` of them
    (module doc): "gpu" is the GPU's time in the step's path, "gpu_beside" its time beside the backward."""
    n, vec = s * batch, chip.cpu_vector_bytes_per_s
    gemm = matmul_flops(vocab, d, n) / chip.cpu_sgemm_flops
    none = {"restage": 0.0, "device": 0.0, "io": 0.0, "gpu": 0.0, "gpu_beside": 0.0}
    if place == "cpu":
        return {**none, "main": 2 * gemm + vocab * n * cross_entropy_s, "dw": gemm}
    if place == "gpu":
        if not has_gpu_figures(chip):
            raise UsageError(f"chip {chip.key} has no published GPU figures (gpu_sgemm_flops, gpu_bytes_per_s); "
                             "expected --head-on ane|cpu for it")
        g = matmul_flops(vocab, d, n) / chip.gpu_sgemm_flops
        copies = 2 * F32 * d * n / vec  # xf in, dx out
        return {**none, "main": copies, "dw": 3 * F32 * vocab * d / vec, "restage": F32 * vocab * d / vec,
                "io": copies, "gpu": 2 * g + GPU_SOFTMAX_BYTES * vocab * n / chip.gpu_bytes_per_s, "gpu_beside": g}
    if place != "ane":
        raise UsageError(f"unknown head placement {place!r}; expected one of {', '.join(PLACES[1:])}")
    cut = tiles(vocab, tile_rows(vocab, s))
    device = io = 0.0
    for t in cut:
        rows = t.stop - t.start
        device += eval_time(tile_cost(d, s, rows), chip).total_s * batch
        io += (d + rows + d + 2) * s * IO_BYTES / vec * batch
    join = len(cut) * 3 * F32 * d * n / vec
    return {**none, "main": device + io + join, "dw": gemm + len(cut) * 2 * F32 * d * n / vec,
            "restage": vocab * d * IO_BYTES / vec, "device": device, "io": io}


def has_gpu_figures(chip) -> bool:
    return "gpu_sgemm_flops" in chip.values and "gpu_bytes_per_s" in chip.values


def path_seconds(h: dict) -> float:
    """A placement's time in the step's path per micro-step, before its restage."""
    return h["main"] + h["gpu"]


def fastest_head(vocab: int, d: int, s: int, batch: int, accum: int, chip, cross_entropy_s: float,
                 gpu: bool = True) -> str:
    """The place whose classifier the model predicts fastest per micro-step on `chip`, its
    restage shared by the update's micro-steps; `gpu` where the chip's figures allow and `gpu`."""
    cost = {}
    for place in ("ane", "cpu", "gpu") if gpu and has_gpu_figures(chip) else ("ane", "cpu"):
        h = head_seconds(place, vocab, d, s, batch, chip, cross_entropy_s)
        cost[place] = path_seconds(h) + h["restage"] / accum
    return min(cost, key=cost.get)


def resolve_head(setting: str, device, vocab: int, d: int, s: int, batch: int, accum: int) -> str:
    """`--head-on` as a step runs it: `auto` resolved (module doc), anything else as given."""
    if setting not in PLACES:
        raise UsageError(f"--head-on: expected one of {', '.join(PLACES)}, got {setting!r}")
    if setting == "gpu":
        gpu_device()  # one line now, before any step is built, where torch finds no GPU
    if setting != "auto":
        return setting
    if getattr(device, "name", None) != "ane":
        return "cpu"
    from ...generate.device_plan import machine_chip

    chip = machine_chip()
    return fastest_head(vocab, d, s, batch, accum, chip, chip.cpu_exp_s, gpu=_gpu_here())


def _gpu_here() -> bool:
    try:
        gpu_device()
    except UsageError:
        return False
    return True
