"""The PNGs `--png FILE` asks for: time against working set (sram), and a roofline (kernels)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..chip.catalog import get_chip  # noqa: E402
from ..chip.cost import attainable_flops, eval_time  # noqa: E402


def sram_png(path: str, rows: list[dict], chips: list[str]) -> None:
    """Predicted time per chip (and measured, where there is a measurement) against working set."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for key in chips:
        pts = [(r["working_set_bytes"] / 2**20, r["predicted_ms"][key]) for r in rows]
        line, = ax.plot(*zip(*pts), marker="o", label=f"{get_chip(key).name}, predicted")
        ax.axvline(get_chip(key).working_set_bytes / 2**20, color=line.get_color(), ls=":", lw=1)
    measured = [(r["working_set_bytes"] / 2**20, r["measured_ms"]) for r in rows if r.get("measured_ms")]
    if measured:
        ax.plot(*zip(*measured), marker="s", color="k", label=f"{rows[0]['measured_on']}, measured")
    ax.set(xscale="log", yscale="log", xlabel="working set of one N×N×N fp16 matmul (MiB, log)",
           ylabel="time per evaluation (ms, log)",
           title="SRAM sweep: matmul time against working set\n(dotted: each chip's measured threshold)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _place_kernels(ax, kernels: list, chip) -> None:
    """One marker per point: a forward kernel and its dx twin (same FLOPs, same bytes) share a
    point and one label. Labels stand in a column right of the points, in the points' vertical
    order and evenly spaced, each joined to its point by a thin line, so none overlap."""
    import math

    points: dict[tuple, list] = {}
    for name, k in kernels:
        x, y = k.intensity, k.total_flops / eval_time(k, chip).total_s / 1e12
        key = (round(math.log10(x), 2), round(math.log10(y), 2))
        points.setdefault(key, [x, y, []])[2].append(name)
    pts = sorted(points.values(), key=lambda p: -p[1])
    if not pts:
        return
    x_label = max(p[0] for p in pts) * 6
    top, bottom = math.log10(max(p[1] for p in pts)) + 0.1, math.log10(min(p[1] for p in pts)) - 0.1
    step = (top - bottom) / max(len(pts) - 1, 1)
    for i, (x, y, names) in enumerate(pts):
        ax.scatter(x, y, zorder=3, s=28, color="C3" if len(names) > 1 else "C2", edgecolor="k", lw=0.5)
        ax.annotate(" = ".join(names), (x, y), xytext=(x_label, 10 ** (top - i * step)), textcoords="data",
                    fontsize=7, va="center", arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"})


def roofline_png(path: str, kernels: list, chip_key: str, title: str) -> None:
    """The chip's roofline (matmul in and past the working set, conv peak, DRAM slope) with each
    kernel (a KernelCost) placed at its intensity and predicted throughput."""
    chip = get_chip(chip_key)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [2 ** (i / 4) for i in range(0, 56)]  # 1 to 16384 FLOP/byte
    for unit, label in (("conv", "conv peak"), ("matmul", "matmul, operands within the working set")):
        ax.plot(xs, [attainable_flops(x, chip, unit) / 1e12 for x in xs], label=label)
    ax.axhline(chip.matmul_flops / 1e12, color="gray", ls="--", lw=1, label="matmul past the working set")
    _place_kernels(ax, kernels, chip)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per DRAM byte, log)",
           ylabel="throughput (TFLOP/s, log)", title=f"{title}\nroofline of {chip.name} (predicted, dispatch included)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", title="red: a forward kernel and its dx twin", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
