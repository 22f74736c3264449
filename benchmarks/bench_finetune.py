"""LoRA fine-tuning of SmolLM2-135M: anelm's LoRA step against PEFT on PyTorch (CPU) and against
anelm's own full fine-tune (`anelm train --init-from`), on the same text, batch and sequence length.

Each variant runs in its own process (so each peak RSS is its own), `--steps` optimizer steps
after one warmup step; the variants take turns for `--rounds` rounds (a shared machine drifts
by tens of percent within a minute), and the best step of each is reported, with the median:

    lora   anelm finetune's loop (train/lora.py + loop.Trainer): rank, alpha, targets as given
    full   anelm train --init-from's loop on the same base (dW, AdamW and restaging for every weight)
    peft   transformers + peft.get_peft_model, float32 on the CPU: forward, backward, clip, AdamW

    python benchmarks/bench_finetune.py                     # rank 8, q_proj,v_proj, batch 1 x 64
    python benchmarks/bench_finetune.py --rank 16 --targets all-linear --rounds 3
    python benchmarks/bench_finetune.py --dropout 0.1          # both LoRA variants with lora_dropout
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from timing import finetune_flags, rounds  # benchmarks/timing.py, beside this script

MODEL = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct-q4_1.gguf"
TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "apache-2.0.txt"
VARIANTS = ("lora", "peft", "full")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ----------------------------------------------------------------------- one variant

def run_anelm(kind: str, a, out: Path) -> dict:
    from anelm.chip.profile import STRICT
    from anelm.device.emulator import Emulator
    from anelm.train.loop import Trainer

    n = a.steps + 1
    explicit = {"init_from": str(a.model), "data": str(a.data), "steps": n, "batch_size": a.batch_size,
                "seq_len": a.seq_len, "lr": 1e-4, "warmup": 0, "eval_every": n, "eval_batches": 1,
                "save_every": n, "sample_tokens": 0}
    if kind == "lora":
        from anelm.train.lora import adapter_writer, prepare_finetune, step_factory

        setup = prepare_finetune(explicit, {"rank": a.rank, "alpha": a.alpha, "targets": a.targets,
                                                 "dropout": a.dropout}, out, False)
        kw = {"step_factory": step_factory(setup), "after_save": adapter_writer(setup)}
    else:
        from anelm.train.run import prepare

        setup, kw = prepare(explicit, out, False), {}
    trainer = Trainer(setup, Emulator(STRICT), progress=False, **kw)
    try:
        recs = trainer.train().records
    finally:
        trainer.close()
    return {"steps": [r["t_step"] for r in recs[1:]], "trainable": sum(int(p.size) for p in setup.params.values()),
            "compiles": [r["compiles"] for r in recs]}


def run_peft(a) -> dict:
    import numpy as np
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    from anelm.models.adapters import resolve_targets
    from anelm.models.loading import load_model

    torch.set_num_threads(a.torch_threads)
    config, _, tok = load_model(a.model)  # the same tokenizer and ids as ours
    ids = np.asarray(tok.encode(a.data.read_text(encoding="utf-8")), np.int64)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(a.model.parent), gguf_file=a.model.name,
                                                              dtype=torch.float32)
    targets = list(resolve_targets(config, a.targets))
    model = peft.get_peft_model(model, peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=a.dropout,
                                                       target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    rng, b, s = np.random.default_rng(0), a.batch_size, a.seq_len
    times = []
    for _ in range(a.steps + 1):
        starts = rng.integers(0, len(ids) - s - 1, b)
        w = torch.from_numpy(np.stack([ids[i:i + s + 1] for i in starts]))
        t0 = time.perf_counter()
        logits = model(w[:, :-1]).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"steps": times[1:], "trainable": sum(p.numel() for p in params), "threads": torch.get_num_threads()}


def worker(a) -> None:
    with tempfile.TemporaryDirectory(prefix="anelm-bench-ft-") as tmp:
        res = run_peft(a) if a.worker == "peft" else run_anelm(a.worker, a, Path(tmp) / "run")
    res["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(res))


# ----------------------------------------------------------------------- the driver

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--data", type=Path, default=TEXT)
    finetune_flags(p, steps=3, batch_size=1, seq_len=64, rank=8, targets="q_proj,v_proj", variants=VARIANTS)
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout of both LoRA variants")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    got = rounds(__file__, VARIANTS, a, ("model", "data", "steps", "batch_size", "seq_len", "rank", "alpha",
                                         "targets", "dropout", "torch_threads"))
    load = os.getloadavg()[0]
    row = {}
    for kind, runs in got.items():
        steps = [t for run in runs for t in run["steps"]]
        row[kind] = (min(steps), statistics.median(steps), max(run["peak_rss_mb"] for run in runs),
                     runs[0]["trainable"])
    print(f"SmolLM2-135M, batch {a.batch_size} x {a.seq_len}, rank {a.rank}, alpha {a.alpha:g}, "
          f"targets {a.targets}, dropout {a.dropout:g}; {a.rounds} rounds x {a.steps} steps each; load average {load:.1f}")
    print("| | step, best | step, median | peak RSS | trainable parameters |\n|---|---|---|---|---|")
    names = {"lora": "anelm finetune (LoRA, emulator)", "peft": "PEFT LoRA, PyTorch CPU float32",
             "full": "anelm train --init-from (full fine-tune, emulator)"}
    for kind in VARIANTS:
        best, med, rss, n = row[kind]
        print(f"| {names[kind]} | {best:.2f} s | {med:.2f} s | {rss:,.0f} MB | {n:,} |")
    lb, pb, fb = row["lora"][0], row["peft"][0], row["full"][0]
    print(f"LoRA step / full fine-tune step: {lb / fb:.2f}x (aim <= 0.7x); LoRA step / PEFT step: "
          f"{lb / pb:.2f}x (aim <= 1x); LoRA peak RSS / full: {row['lora'][2] / row['full'][2]:.2f}x; "
          f"compiles per LoRA step after the first: {got['lora'][0]['compiles']}")


if __name__ == "__main__":
    main()
