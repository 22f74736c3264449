"""What a run reports: `metrics.jsonl`, `loss.png`, and the progress bar on stderr.

`metrics.jsonl` (docs/training.md) has one JSON object per line: a step record per optimizer step,
`{"step", "loss", "lr", "loss_scale", "tokens_per_s", "device", "device_flops", "cpu_flops",
...}`, and eval records `{"step", "eval_loss"}`, which never use the key `loss` so a reader can
tell the two apart by keys alone. Non-finite numbers are written as null (JSON has no NaN).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..atomic import atomic_open

METRICS = "metrics.jsonl"
PLOT = "loss.png"


def _clean(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of a run; a torn last line (a kill mid-write) is skipped."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class MetricsLog:
    """Appends records to `RUN/metrics.jsonl`, one write and flush per record.

    With `resume_step`, records after that step are dropped first: they came from steps the
    killed run did past its last checkpoint, and the resumed run logs them again.
    """

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            kept = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= resume_step]
            _write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self._f = open(self.path, "a", encoding="utf-8")

    def _write(self, rec: dict) -> dict:
        rec = {k: _clean(v) for k, v in rec.items()}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        return rec

    def log_step(self, step: int, loss: float, lr: float, loss_scale: float, tokens_per_s: float,
                 device: str, device_flops: int, cpu_flops: int, **extra) -> dict:
        """One optimizer step; `extra` adds keys such as skipped, grad_norm, timings."""
        if "eval_loss" in extra:
            raise ValueError("metrics: a step record must not carry eval_loss; log it with log_eval")
        return self._write({"step": step, "loss": loss, "lr": lr, "loss_scale": loss_scale,
                            "tokens_per_s": tokens_per_s, "device": device,
                            "device_flops": device_flops, "cpu_flops": cpu_flops, **extra})

    def log_eval(self, step: int, eval_loss: float, **extra) -> dict:
        """One evaluation; never uses the key `loss`, which marks step records."""
        if "loss" in extra:
            raise ValueError("metrics: an eval record must not use the key 'loss'")
        return self._write({"step": step, "eval_loss": eval_loss, **extra})

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NullLog(MetricsLog):
    """The records of a rank other than 0 in data-parallel training: built, never written
    (rank 0 alone writes metrics.jsonl, docs/distributed.md)."""

    def __init__(self):
        pass

    def _write(self, rec: dict) -> dict:
        return {k: _clean(v) for k, v in rec.items()}

    def close(self) -> None:
        pass


def _write_atomic(path: Path, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def loss_figure(recs: list[dict], reference: float | None = None):
    """A matplotlib Figure of train and eval loss from metrics records, on a log loss axis:
    on a linear one the second half of a run is a flat strip at the bottom. `reference` (the
    corpus's unigram entropy, which the run's last line compares the final eval loss against)
    is drawn as a labelled horizontal line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state, safe off the main thread
    from matplotlib.ticker import LogFormatter, MaxNLocator

    train = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), lw=1, label="train")
    if evals:
        ax.plot(*zip(*evals), "o-", ms=3, label="eval")
    if reference is not None and math.isfinite(reference) and reference > 0:
        ax.axhline(reference, color="grey", ls="--", lw=1,
                   label=f"corpus unigram entropy ({reference:.2f} nats)")
    ax.set_yscale("log")
    # plain numbers ("2", "0.9") at the decades and at the subdivisions it labels, not 2×10⁰
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats, log scale)")
    ax.grid(alpha=0.3, which="both")
    if ax.get_lines():
        ax.legend()
    fig.tight_layout()
    return fig


def plot_loss(run_dir: str | Path, reference: float | None = None) -> Path:
    """Draw `loss_figure` of `RUN/metrics.jsonl` into `RUN/loss.png`, replaced atomically so a
    viewer never sees a half-written image."""
    fig = loss_figure(read_metrics(run_dir), reference)
    path = Path(run_dir) / PLOT
    with atomic_open(path) as f:
        fig.savefig(f, format="png")
    return path


class Progress:
    """Live bar on stderr: step n/total, elapsed<ETA, steps/s, then loss and tokens/s."""

    def __init__(self, total: int, initial: int = 0, disable: bool | None = None):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, file=sys.stderr, unit="step", desc="train",
                        dynamic_ncols=True, disable=disable)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Move the bar to `step` (steps completed) and show the latest loss and throughput."""
        self.bar.set_postfix_str(f"loss={loss:.4f} tok/s={tokens_per_s:,.0f}", refresh=False)
        self.bar.update(step - self.bar.n)

    def write(self, msg: str) -> None:
        """A notice on stderr that does not tear the bar."""
        self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
